"""A name or path from a file in an error is shown escaped exactly once (``visible``).

The error line is made visible whole where it is reported; a piece that was
quoted with repr() or passed through ``visible`` before showed its backslashes
doubled again (``'w\\\\\\\\x'`` for ``w\\x``).
"""

from __future__ import annotations

import json
import struct

from gradclip_cli.escaping import visible

# A backslash and a control character: each escaped once by ``visible``.
HOSTILE = "w\\x\t1"


def _raw_safetensors(path, tensors: dict, data: bytes) -> None:
    header = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _shown_once(r, name: str) -> str:
    line = r.err_lines[-1]
    assert r.code == 3, r.err
    assert f"'{visible(name)}'" in line, line
    return line


def test_a_safetensors_tensor_name_in_a_header_error(gradclip, tmp_path):
    path = tmp_path / "f.safetensors"
    _raw_safetensors(path, {HOSTILE: {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                     bytes(8))
    line = _shown_once(gradclip("inspect", path), HOSTILE)
    assert f"tensor '{visible(HOSTILE)}' needs 12 bytes, has 8" in line, line


def test_a_safetensors_tensor_name_in_a_verify_error(gradclip, tmp_path):
    path = tmp_path / "f.safetensors"
    _raw_safetensors(path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            HOSTILE: {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
                     bytes(8))
    line = _shown_once(gradclip("inspect", path, "--verify"), HOSTILE)
    assert f"tensor '{visible(HOSTILE)}' overlaps the one before it" in line, line


def test_a_path_in_a_corrupt_safetensors_header_error(gradclip, tmp_path):
    path = tmp_path / f"{HOSTILE}.safetensors"
    _raw_safetensors(path, {}, b"")
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    r = gradclip("inspect", path)
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line.startswith(f"gradclip: {visible(path)}: corrupt safetensors header"), line


def _sharded_set(folder, weight_map: dict, shard: dict) -> None:
    import torch

    from tests.safetensors_files import save_safetensors

    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_safetensors(folder / "a.safetensors", {n: torch.ones(2) for n in shard})


def test_a_tensor_name_in_a_sharded_set_error(gradclip, tmp_path):
    lacking = tmp_path / "lacking"
    _sharded_set(lacking, {HOSTILE: "a.safetensors", "b": "a.safetensors"}, ["b"])
    line = _shown_once(gradclip("inspect", lacking), HOSTILE)
    assert f"lacks '{visible(HOSTILE)}', which model.safetensors.index.json puts there" in line
    unlisted = tmp_path / "unlisted"
    _sharded_set(unlisted, {"b": "a.safetensors"}, ["b", HOSTILE])
    line = _shown_once(gradclip("inspect", unlisted), HOSTILE)
    assert f"holds '{visible(HOSTILE)}', which model.safetensors.index.json does not" in line


def test_a_name_quoted_from_a_small_file(gradclip, tmp_path):
    """``excerpt``: a cut of a small file's content, quoted in the error."""
    folder = tmp_path / "set"
    _sharded_set(folder, {HOSTILE: 1, "b": "a.safetensors"}, ["b"])
    line = _shown_once(gradclip("inspect", folder), HOSTILE)
    assert f"weight_map maps '{visible(HOSTILE)}' to a int, not a file name" in line, line


def _dcp_folder(folder, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder))


def test_a_key_in_dcp_metadata_errors(gradclip, tmp_path):
    import torch

    folder = tmp_path / "dcp"
    _dcp_folder(folder, {HOSTILE: {"a": torch.ones(64)}})
    line = _shown_once(gradclip("inspect", folder, "--key", "nope"), HOSTILE)
    assert f"(top-level keys: '{visible(HOSTILE)}')" in line, line
    line = _shown_once(gradclip("inspect", folder, "--key", f"{HOSTILE}.b"), f"{HOSTILE}.b")
    assert f"--key '{visible(HOSTILE)}.b': no tensors under it" in line, line
    (data,) = folder.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:64])
    line = _shown_once(gradclip("inspect", folder), f"{HOSTILE}.a")
    assert f"truncated: .metadata puts '{visible(HOSTILE)}.a' at bytes" in line, line


def test_names_in_an_optimizer_state_error(gradclip, tmp_path):
    import torch

    stranger = "p\\q\x1b"
    path = tmp_path / "opt.pt"
    torch.save({HOSTILE: {"state": {stranger: {"exp_avg": torch.ones(2)}},
                          "param_groups": [{"params": [0], "lr": 0.1}]},
                "model": {"w": torch.ones(2)}}, path)
    line = _shown_once(gradclip("inspect", path, "--key", HOSTILE), HOSTILE)
    assert (f"'{visible(HOSTILE)}' is not an optimizer state dict: state is keyed by "
            f"'{visible(stranger)}', not by integer parameter ids") in line, line


def test_a_tracker_tag_in_trend_errors(gradclip, tmp_path):
    """A TensorBoard tag, in the list of a run's tags and at a point refused."""
    from tests import tracker_runs as tr

    tr.needs("tensorboard")
    folder = tmp_path / "tb"
    tr.write_torch_tensorboard(folder, tag=HOSTILE, norms={0: 1.0, 1: -1.0})
    line = _shown_once(gradclip("trend", folder), HOSTILE)
    assert f"its 2 tag(s): 'train/loss', '{visible(HOSTILE)}'; give --tag NAME" in line, line
    line = _shown_once(gradclip("trend", folder, "--tag", HOSTILE), HOSTILE)
    assert line.endswith(f": tag '{visible(HOSTILE)}': step 1: a norm must be >= 0, got -1"), line


def test_a_key_in_a_deepspeed_module_error(gradclip, tmp_path):
    """A DeepSpeed model state file's 'module' entry that is not a tensor, named by key."""
    import torch

    tag = tmp_path / "run" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2), HOSTILE: 1}, "ds_version": "0.14.0",
                "dp_world_size": 1, "mp_world_size": 1, "buffer_names": []},
               tag / "mp_rank_00_model_states.pt")
    (tmp_path / "run" / "latest").write_text("global_step1")
    line = _shown_once(gradclip("inspect", tmp_path / "run"), HOSTILE)
    assert line.endswith(f"mp_rank_00_model_states.pt: 'module' holds '{visible(HOSTILE)}', "
                         "which is not a named tensor"), line


def test_an_iteration_in_a_megatron_legacy_error(gradclip, tmp_path):
    """A legacy Megatron checkpoint's iteration that is no step, quoted as the file has it."""
    import argparse

    import torch

    rank = tmp_path / "run" / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.save({"args": args, "iteration": HOSTILE, "checkpoint_version": 3.0,
                "model": {"w": torch.ones(2)}}, rank / "model_optim_rng.pt")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("1")
    line = _shown_once(gradclip("inspect", tmp_path / "run"), HOSTILE)
    assert line.endswith(f"model_optim_rng.pt: iteration is '{visible(HOSTILE)}', not a step"), line


def test_a_parameter_name_in_a_previous_error(gradclip, tmp_path):
    """--previous refusing a pair whose betas differ names the parameter as its model
    state dict does."""
    import torch

    from tests.previous_runs import train

    def change(step, opt):
        if step == 3:
            opt.param_groups[0]["betas"] = (0.8, 0.999)

    def save(model, opt):
        state = model.state_dict()
        first = next(iter(state))
        return {"model": {(HOSTILE if k == first else k): v for k, v in state.items()},
                "optimizer": opt.state_dict()}

    run = train(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), steps=3,
                before_step=change, save=save)
    r = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2))
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert (f"betas differs for parameter {visible(HOSTILE)}: (0.9, 0.999) in "
            f"{visible(run.checkpoint(2))}, (0.8, 0.999) in ") in line, line


def test_a_hyperparameter_and_a_parameter_name_in_an_optimizer_error(gradclip, tmp_path):
    """An Adam lr that is text, named with its parameter, both escaped once."""
    import torch

    from tests.previous_runs import train

    def save(model, opt):
        state = model.state_dict()
        first = next(iter(state))
        saved = opt.state_dict()
        saved["param_groups"][0]["lr"] = HOSTILE
        return {"model": {(HOSTILE if k == first else k): v for k, v in state.items()},
                "optimizer": saved}

    run = train(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), steps=3,
                save=save)
    r = gradclip("inspect", run.checkpoint(3), "--what", "update")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line.endswith(f"parameter {visible(HOSTILE)}: lr is '{visible(HOSTILE)}', "
                         "not a finite number"), line


def test_a_count_in_a_torchtune_recipe_state_error(gradclip, tmp_path):
    """torchtune's recipe state whose epochs_run is text, quoted as the file has it."""
    import torch

    from tests.safetensors_files import save_safetensors

    (tmp_path / "out" / "epoch_0").mkdir(parents=True)
    (tmp_path / "out" / "recipe_state").mkdir()
    save_safetensors(tmp_path / "out" / "epoch_0" / "model-00001-of-00001.safetensors",
                     {"w": torch.ones(2)})
    torch.save({"epochs_run": HOSTILE, "seed": 0},
               tmp_path / "out" / "recipe_state" / "recipe_state.pt")
    line = _shown_once(gradclip("inspect", tmp_path / "out"), HOSTILE)
    assert line.endswith(f"recipe_state.pt: not a torchtune recipe state: epochs_run is "
                         f"'{visible(HOSTILE)}', not a count of epochs"), line


def test_a_tensorboard_folder_named_in_trend_errors(gradclip, tmp_path):
    """A tracker's folder (its path) in a point refused, and in a damaged event file."""
    from tests import tracker_runs as tr

    tr.needs("tensorboard")
    folder = tmp_path / HOSTILE
    events = tr.write_torch_tensorboard(folder, norms={0: 1.0, 1: -1.0})
    r = gradclip("trend", folder)
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line == (f"gradclip: {visible(events)}: tag '{tr.TAG}': step 1: a norm must be "
                    ">= 0, got -1"), line
    events.write_bytes(events.read_bytes()[:-7])
    r = gradclip("trend", folder, "--format", "json")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line.startswith(f"gradclip: {visible(events)}: truncated or damaged at byte"), line
    assert json.loads(r.out)["error"] == line.removeprefix("gradclip: ")


def test_a_monitor_log_named_in_trend_errors(gradclip, tmp_path):
    """gradclip's own norm log (GradMonitor's), a line damaged: named file:line."""
    import torch

    from gradclip import GradMonitor

    log = tmp_path / HOSTILE / "grads.jsonl"
    log.parent.mkdir()
    model = torch.nn.Linear(2, 2)
    monitor = GradMonitor(model, log, None)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        monitor.step()
    monitor.close()
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(lines[0] + "{}\n" + "".join(lines[2:]))
    r = gradclip("trend", log, "--format", "github")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line.startswith(f"gradclip: {visible(log)}:2: "), line
    assert r.out.startswith("::error ") and r.out.rstrip("\n").endswith(
        "::" + line.removeprefix("gradclip: ")), r.out


def _monitor_run(log, scale: float = 1.0, steps: int = 3) -> None:
    """A GradMonitor log of ``steps`` steps, its gradients all ``scale``."""
    import torch

    from gradclip import GradMonitor

    log.parent.mkdir(parents=True, exist_ok=True)
    model = torch.nn.Linear(2, 2)
    monitor = GradMonitor(model, log, None)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)
        monitor.step()
    monitor.close()


def test_norm_logs_named_in_trend_and_autopsy_refusals(gradclip, tmp_path):
    """Two runs' logs giving one step other norms, and --group-by on a log: each path
    once escaped, in trend's and autopsy's refusals."""
    a, b = tmp_path / HOSTILE / "a.jsonl", tmp_path / HOSTILE / "b.jsonl"
    _monitor_run(a)
    _monitor_run(b, scale=2.0)
    for command in ("trend", "autopsy"):
        r = gradclip(command, a, b, "--format", "json")
        assert r.code == 2, r.err
        line = r.err_lines[-1]
        assert line.startswith(f"gradclip: {visible(b)} and {visible(a)} both give step 0, "
                               "with other norms"), line
        assert json.loads(r.out)["error"] == line.removeprefix("gradclip: ")
    r = gradclip("trend", a, "--group-by", "module")
    assert r.code == 2, r.err
    assert r.err_lines[-1].startswith(f"gradclip: {visible(a)}: --group-by groups a "
                                      "checkpoint's tensors"), r.err


def test_a_parameter_name_in_an_optimizer_group_error(gradclip, tmp_path):
    """An Adam group whose betas leave [0, 1), named by its parameter, escaped once."""
    import torch

    from tests.previous_runs import train

    def save(model, opt):
        state = model.state_dict()
        first = next(iter(state))
        saved = opt.state_dict()
        saved["param_groups"][0]["betas"] = (0.9, 1.5)
        return {"model": {(HOSTILE if k == first else k): v for k, v in state.items()},
                "optimizer": saved}

    run = train(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), steps=3,
                save=save)
    r = gradclip("inspect", run.checkpoint(3), "--what", "update")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line.endswith(f"the param group of {visible(HOSTILE)} has betas (0.9, 1.5) "
                         "outside [0, 1)"), line


def test_a_run_folder_named_in_inspects_refusal(gradclip, tmp_path):
    """inspect of a run's folder says what it is and where to go, the folder once escaped."""
    import torch

    folder = tmp_path / HOSTILE
    folder.mkdir()
    for step in (1, 2):
        torch.save({"w": torch.ones(2)}, folder / f"step_{step}.pt")
    r = gradclip("inspect", folder)
    assert r.code == 3, r.err
    assert r.err_lines[-1] == (
        f"gradclip: {visible(folder)}: a run's folder of 2 per-step checkpoint files "
        f"(step_1.pt .. step_2.pt), not one checkpoint: for norms over the run use 'gradclip "
        f"trend {visible(folder)}'; to inspect the newest, 'gradclip inspect "
        f"{visible(folder / 'step_2.pt')}'"), r.err


def test_a_buffer_name_as_the_proof_of_weights(gradclip, tmp_path):
    """--what grads on a model's weights: the buffer that shows them weights, in the
    refusal, escaped once (and once in the measured line: tests/cli/test_cli_notes_...)."""
    import torch

    buffer = f"{HOSTILE}.running_mean"
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3), buffer: torch.ones(2)}, path)
    r = gradclip("inspect", path, "--what", "grads")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert (f"the file is a model's weights (a model's buffers: {visible(buffer)}), not "
            "gradients") in line, line


def test_an_unknown_optimizers_state_key_in_a_refusal(gradclip, tmp_path):
    """A torch.optim.Optimizer of a script's own, whose state key gradclip knows no rule
    for: --what exp_avg names the key once escaped."""
    import torch

    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p][HOSTILE] = p.grad.clone()

    model = torch.nn.Linear(2, 1)
    opt = Custom(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    r = gradclip("inspect", path, "--what", "exp_avg")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert f"state keys ({visible(HOSTILE)})" in line, line


def test_a_report_file_that_cannot_hold_the_failure_document_is_named_once_escaped(
        gradclip, tmp_path):
    # The run fails on --output-file's folder; writing the failure document there fails
    # again with the same error, which was printed a second time, raw (an escape
    # sequence reached the terminal).
    report = tmp_path / f"{HOSTILE}\x1b[31m" / "report.json"
    r = gradclip("inspect", tmp_path / "missing.pt", "--format", "json",
                 "--output-file", report)
    assert r.code == 3, r.err
    assert "\x1b" not in r.err, r.err
    lines = [line for line in r.err_lines if "cannot write" in line]
    assert lines == [f"gradclip: {visible(report)}: cannot write: the folder "
                     f"{visible(report.parent)} does not exist"], r.err
    assert r.json()["exit_code"] == 3
