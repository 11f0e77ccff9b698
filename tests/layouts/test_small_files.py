"""The small files inside every layout follow one rule (docs/reference/contract.md, "Safety").

``latest``, ``trainer_state.json``, ``config.json``, ``optimizer.pt``, an index,
DCP's ``.metadata``, Lightning's ``meta.pt``: each is read only when it is a
regular file whose real path lies inside the checkpoint's folder, bounded, and
an error never quotes a refused file's content. The checkpoints are real
(DeepSpeed, a Trainer, FSDP2's DCP, Lightning, accelerate,
``save_torch_state_dict``), then one small file is replaced by:

* a FIFO: opening it would block until a writer came;
* a link to ``/dev/zero``: endless bytes;
* a link to a valid copy of itself outside the folder: reading it would succeed;
* a link to ``/proc/self/environ``: the process's environment, secrets included.

A FIFO and a device are never opened (exit 3, or the layout does without the
file: a folder whose ``meta.pt`` is no file is a plain DCP folder). A link out
is exit 3 with one line naming the file, and the environment's secret is never
printed, neither on stderr nor in the JSON error document.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.cli.support import run_process
from tests.hardening.support import run_cli
from tests.hardening.test_json_inputs import DEEP, json_error, refused

SECRET = "gradclip-test-secret-4d1f7a"


@pytest.fixture
def sharded_set(tmp_path_factory) -> Path:
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(3)
    folder = tmp_path_factory.mktemp("sharded") / "set"
    folder.mkdir()
    state = {f"layer.{i}.weight": torch.randn(20, 20, generator=g) for i in range(4)}
    save_torch_state_dict(state, folder, max_shard_size=4000)
    return folder


# (fixture, the checkpoint inside it, the small files it holds)
LAYOUTS = {
    "trainer": ("trainer_run", ".", ["trainer_state.json", "config.json", "optimizer.pt",
                                     "model.safetensors"]),
    "deepspeed": ("deepspeed_runs", "zero2", ["latest"]),
    "dcp": ("dcp_checkpoint", ".", [".metadata"]),
    "lightning": ("lightning_sharded", ".", ["meta.pt", ".metadata"]),
    "accelerate": ("accelerate_fsdp_run", "checkpoint-1",
                   ["trainer_state.json", "pytorch_model_fsdp_0/.metadata"]),
    "sharded": ("sharded_set", ".", ["model.safetensors.index.json"]),
}  # fmt: skip
CASES = [(layout, name) for layout, (_, _, names) in LAYOUTS.items() for name in names]


def _copy(request, tmp_path, layout: str) -> Path:
    fixture, inner, _ = LAYOUTS[layout]
    source = Path(request.getfixturevalue(fixture)) / inner
    # checkpoint-4: a Trainer's folder name must agree with its global_step.
    target = tmp_path / ("checkpoint-4" if layout == "trainer" else "ckpt")
    shutil.copytree(source, target)
    return target


def _run_unblocked(fifo: Path, *args) -> object:
    """``run_cli(*args)`` on a thread; should it block (on the FIFO), a writer unblocks it
    and the test fails."""
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("r", run_cli(*args)),
                              daemon=True)
    worker.start()
    worker.join(120)
    if worker.is_alive():
        with open(fifo, "wb"):
            pass
        worker.join(30)
        pytest.fail(f"gradclip {' '.join(map(str, args))} blocked on the FIFO {fifo}")
    return outcome["r"]


def _one_line(result, *fragments: object) -> str:
    return refused(result, *fragments)


@pytest.mark.parametrize("layout, name", CASES)
def test_a_fifo_never_blocks(request, tmp_path, layout, name):
    folder = _copy(request, tmp_path, layout)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    result = _run_unblocked(folder / name, "inspect", folder, "--what", "auto")
    if result.code != 0:  # exit 0: the layout did without it (never opened it)
        _one_line(result, folder)


@pytest.mark.parametrize("layout, name", CASES)
def test_a_link_to_dev_zero_is_never_read(request, tmp_path, layout, name):
    folder = _copy(request, tmp_path, layout)
    (folder / name).unlink()
    (folder / name).symlink_to("/dev/zero")
    result = _run_unblocked(folder / name, "inspect", folder, "--what", "auto")
    if result.code != 0:
        _one_line(result, folder)


@pytest.mark.parametrize("layout, name", CASES)
def test_a_valid_copy_linked_from_outside_is_refused(request, tmp_path, layout, name):
    folder = _copy(request, tmp_path, layout)
    outside = tmp_path / "outside" / name
    outside.parent.mkdir(parents=True)
    shutil.move(folder / name, outside)
    (folder / name).symlink_to(outside)
    line = _one_line(run_cli("inspect", folder, "--what", "auto"), folder / name)
    assert "outside" in line


@pytest.mark.parametrize("layout, name", [
    ("deepspeed", "latest"), ("trainer", "trainer_state.json"), ("trainer", "config.json"),
    ("dcp", ".metadata"), ("sharded", "model.safetensors.index.json"),
])  # fmt: skip
@pytest.mark.parametrize("format", ["table", "json"])
def test_the_environment_is_never_printed(request, tmp_path, layout, name, format):
    """A small file linked to /proc/self/environ (the DeepSpeed ``latest`` of the issue):
    refused before reading, so no part of the environment reaches stderr or stdout."""
    folder = _copy(request, tmp_path, layout)
    (folder / name).unlink()
    (folder / name).symlink_to("/proc/self/environ")
    result = run_process("inspect", folder, "--what", "auto", "--format", format,
                         env={"GRADCLIP_SECRET_TOKEN": SECRET})
    line = _one_line(result, folder)  # the file, or the folder no layout then recognises
    assert "outside" in line or "not a checkpoint" in line, line
    assert SECRET not in result.err and SECRET not in result.out
    assert "GRADCLIP_SECRET_TOKEN" not in result.err + result.out


def test_a_tag_longer_than_an_excerpt_is_cut(request, tmp_path):
    """``latest`` inside the folder, naming no folder: the message quotes the start of the
    tag, escaped, never all of it."""
    folder = _copy(request, tmp_path, "deepspeed")
    tag = "global_step" + "9" * 3000 + "\x1b[2J"
    (folder / "latest").write_text(tag)
    line = _one_line(run_cli("inspect", folder), folder / "latest")
    assert "global_step999" in line and tag not in line and "\x1b" not in line
    assert len(line) < 400


def test_trend_of_a_fifo_never_blocks(tmp_path):
    fifo = tmp_path / "norms.jsonl"
    os.mkfifo(fifo)
    _one_line(_run_unblocked(fifo, "trend", fifo), fifo, "FIFO")


def test_trend_of_a_log_linked_to_dev_zero(tmp_path):
    log = tmp_path / "trainer_state.json"
    log.symlink_to("/dev/zero")
    _one_line(_run_unblocked(log, "trend", log), log, "character device")


# ------------------------------------------------------------- JSON inside the layouts


@pytest.mark.parametrize("edit, words", [
    (lambda d: json.dumps(d)[:-1] + ', "deeper": ' + DEEP + "}", "nested too deeply"),
    (lambda d: json.dumps(d)[:-1] + ', "best_metric": ' + "9" * 5000 + "}",
     "an integer of 5000 digits"),
])  # fmt: skip
@pytest.mark.parametrize("name", ["trainer_state.json", "config.json"])
def test_a_trainer_checkpoint_json_file(request, tmp_path, name, edit, words):
    trainer_copy = _copy(request, tmp_path, "trainer")
    file = trainer_copy / name
    file.write_text(edit(json.loads(file.read_text())))
    result = run_cli("inspect", trainer_copy, "--what", "exp_avg", "--format", "json")
    refused(result, file, words)
    json_error(result)


def test_a_config_that_lies_about_its_layers(request, tmp_path):
    """``n_layer: 3000`` in a few hundred bytes: refused naming the file before any model is
    built (it took 120 s and 2.6 GB), since the checkpoint stores far fewer tensors."""
    trainer_copy = _copy(request, tmp_path, "trainer")
    config = trainer_copy / "config.json"
    document = json.loads(config.read_text())
    stored = document["n_layer"]
    document["n_layer"] = 3000
    config.write_text(json.dumps(document))
    line = refused(run_cli("inspect", trainer_copy, "--what", "exp_avg"), config,
                    "n_layer", "3000", "weight tensors")
    assert "refusing to build" in line
    document["n_layer"] = stored  # the truth is still read as before
    config.write_text(json.dumps(document))
    assert run_cli("inspect", trainer_copy, "--what", "exp_avg").code in (0, 1)


def test_an_index_nested_deeply(sharded_set):
    folder = sharded_set
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    index.write_text(json.dumps(document)[:-1] + ', "extra": ' + DEEP + "}")
    result = run_cli("inspect", folder, "--format", "json")
    refused(result, index, "nested too deeply")
    json_error(result)


# ------------------------------------------------------------- fuzzing the small files

# Each example opens a real checkpoint (up to 2 s for DeepSpeed's): a tenth of the count.
_SMALL_FUZZ = settings(max_examples=max(5, int(os.environ.get("GRADCLIP_FUZZ_EXAMPLES", "100"))
                                        // 10), deadline=None, database=None,
                       suppress_health_check=[HealthCheck.too_slow,
                                              HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("layout, name", [
    ("trainer", "trainer_state.json"), ("trainer", "config.json"), ("deepspeed", "latest"),
    ("accelerate", "trainer_state.json"), ("sharded", "model.safetensors.index.json"),
])  # fmt: skip
def test_fuzz_small_files_of_real_layouts(request, tmp_path, layout, name):
    """Mutated bytes of a real layout's small file: a report (exit 0 or 1, JSON), or exit 3
    with one line naming the folder or a file in it; never a traceback."""
    from tests.hardening.test_fuzz import _apply, _mutations

    folder = _copy(request, tmp_path, layout)
    file = folder / name
    original = file.read_bytes()

    @_SMALL_FUZZ
    @given(mutations=_mutations(len(original)))
    def run(mutations):
        file.write_bytes(_apply(original, mutations))
        result = run_cli("inspect", folder, "--what", "auto", "--format", "json")
        assert "Traceback" not in result.err, result.err
        if result.code in (0, 1):
            assert json.loads(result.out)["schema"] == "gradclip.inspect/1"
        else:
            refused(result, folder)
            json_error(result)

    try:
        run()
    finally:
        file.write_bytes(original)
