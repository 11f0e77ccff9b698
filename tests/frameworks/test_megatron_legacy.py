"""Megatron legacy format: Megatron-LM's own ``save_checkpoint`` (``--ckpt-format torch``) on
1 rank and on 2 tensor-parallel ranks (``megatron_lm_run.py``), each also with Megatron's
distributed optimizer (``--use-distributed-optimizer``: ``distrib_optim.pt`` beside each
rank's file; bf16, grad buffers of 3000-element buckets), which also runs on 2
data-parallel ranks and on 2 tensor- x 2 data-parallel ranks (each data-parallel rank
steps its share of every bucket; the first gathers them into distrib_optim.pt), on 2
pipeline stages (``mp_rank_00_000``, ``mp_rank_00_001``) trained through Megatron-core's
own 1F1B schedule, and on 2 tensor-parallel ranks of each of 2 stages (4 ranks,
``mp_rank_0T_00S``).

References never go through gradclip: Megatron-LM's own ``load_checkpoint`` reads each step
back into a fresh model and optimizer (in the generator's venv), which records each
parameter's weights (the fp32 masters under bf16), torch's AdamW state found through the
parameter objects, and Megatron's ``param_is_not_tensor_parallel_duplicate``: the
parameters its ``get_grad_norm_fp32`` counts on each rank (with pipeline stages, also not
``shared``), and each stage's layers' own ``layer_number``. The moments' bias corrections
and updates are computed here in float64.

Needs ``MEGATRON_LM_PATH`` (a Megatron-LM checkout at tag core_v0.16.1); skipped without.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli.support import rel_err

from .conftest import run_generator
from .support import (
    QUANTITIES,
    TOL,
    RunsCode,
    norm,
    one_line_exit_3,
    same_under_torchrun,
    skip_without_frameworks,
)

skip_without_frameworks()

STEPS = (1, 2, 3)
TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"


def _references(run: Path, step: int) -> list[dict]:
    found = sorted((run / "reference").glob(f"iter_{step}.rank*.pt"))
    return [torch.load(f, weights_only=True) for f in found]


def _expected(refs: list[dict], what: str) -> dict[str, torch.Tensor]:
    """Name -> the float64 quantity over the elements Megatron counts: each rank's shard of a
    split parameter, a replicated one on the first rank only (every rank counts it)."""
    out: dict[str, list[torch.Tensor]] = {}
    for r, ref in enumerate(refs):
        for name, counted in ref["counted"].items():
            if not counted and r > 0:
                continue
            if what == "weights":
                value = ref.get("masters", ref["weights"])[name].double()
            else:
                s, h = ref["state"][name], ref["hyper"][name]
                (beta1, beta2), step = h["betas"], s["step"]
                m = s["exp_avg"].double() / (1 - beta1**step)
                v = s["exp_avg_sq"].double() / (1 - beta2**step)
                value = {
                    "exp_avg": m,
                    "grad_rms": v.sqrt(),
                    "update": h["lr"] * m / (v.sqrt() + h["eps"]),
                }[what]
            out.setdefault(name, []).append(value.reshape(-1))
    return {n: torch.cat(v) for n, v in out.items()}


@pytest.fixture(scope="module")
def distopt_runs(megatron_lm_runs, tmp_path_factory) -> dict[str, Path]:
    """Megatron's distributed optimizer, on 1 rank (its output layer tied, Megatron's
    default), on 2 tensor-parallel ranks (untied), on 2 data-parallel ranks (tied: each
    steps half of every bucket, which distrib_optim.pt gathers), and on 2 tensor- x 2
    data-parallel ranks (untied); bf16, as large runs train."""
    python = megatron_lm_runs["python"]
    out = {}
    for name, ranks, extra in (
        ("distopt", 1, ("tied",)),
        ("distopt_tp2", 2, ("tp",)),
        ("distopt_dp2", 2, ("tied",)),
        ("distopt_tp2_dp2", 4, ("tp", "dp2")),
    ):
        folder = tmp_path_factory.mktemp(f"megatron_lm_{name}")
        out[name] = run_generator(
            python, "megatron_lm_run.py", folder, ranks, *extra, "bf16", "distopt"
        )
    return out


@pytest.fixture(
    scope="module",
    params=["fp32", "tp2", "distopt", "distopt_tp2", "distopt_dp2", "distopt_tp2_dp2"],
)
def run(request, megatron_lm_runs) -> Path:
    if request.param.startswith("distopt"):
        return request.getfixturevalue("distopt_runs")[request.param]
    return megatron_lm_runs[request.param]


def test_the_fixture_is_megatrons_legacy_layout(run):
    save = run / "run"
    assert (save / TRACKER).read_text() == "3"
    ranks = sorted(p.name for p in (save / "iter_0000003").iterdir())
    references = len(list((run / "reference").glob("iter_3.rank*.pt")))
    assert ranks == [f"mp_rank_{r:02d}" for r in range(references)]
    with pytest.raises(Exception, match="Namespace"):  # args: not weights-only loadable
        torch.load(save / "iter_0000003" / "mp_rank_00" / FILE, weights_only=True)
    assert b"_extra_state" in (save / "iter_0000003" / "mp_rank_00" / FILE).read_bytes()


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_megatrons_load(gradclip, run, step, what):
    _inspected_as_loaded(gradclip, run, step, what, _references(run, step), layers=(0, 1))


def _inspected_as_loaded(gradclip, run, step, what, refs, layers):
    """``inspect --what what`` of ``run``'s iteration ``step`` against Megatron's own load
    (``refs``): the total, every tensor with its ratio, and each of ``layers`` a group."""
    expected, weights = _expected(refs, what), _expected(refs, "weights")
    result = gradclip(
        "inspect", run / "run" / f"iter_{step:07d}", "--what", what, "--format", "json"
    )
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("megatron-legacy", step, what)
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        if what != "weights":
            assert rel_err(row["ratio"], norm([expected[name]]) / norm([weights[name]])) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in layers:  # each layer a group of its own
        members = [n for n in expected if n.startswith(f"decoder.layers.{layer}.")]
        assert members
        assert (
            rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(expected[n] for n in members))
            <= TOL
        )


def test_split_and_replicated_as_megatron_counts_them(gradclip, megatron_lm_runs):
    """The full shape of a split parameter is its shards side by side; a replicated one keeps
    its own: the same parameters Megatron's param_is_not_tensor_parallel_duplicate says."""
    run = megatron_lm_runs["tp2"]
    refs = _references(run, 3)
    result = gradclip("inspect", run / "run", "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    for row in doc["tensors"]:
        shard = list(refs[1]["weights"][row["name"]].shape)
        if refs[1]["counted"][row["name"]]:  # split: twice the shard along one axis
            assert row["shape"] != shard and sorted(
                a // b for a, b in zip(row["shape"], shard)
            ) == [1] * (len(shard) - 1) + [2]
        else:
            assert row["shape"] == shard, row["name"]
    assert any(not c for c in refs[1]["counted"].values())  # the fixture replicates some
    assert "replicated (counted once" in " ".join(doc["description"])
    assert "fp32 masters" in " ".join(doc["description"])


@pytest.mark.parametrize("given", ["file", "folder"])
@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_one_rank_alone(gradclip, megatron_lm_runs, given, what):
    """One tensor-parallel rank's file (or its mp_rank_XX/ folder): that rank's shards, every
    one counted, and the report says it covers that rank only."""
    run = megatron_lm_runs["tp2"]
    ref = _references(run, 3)[1]
    expected = _expected([{**ref, "counted": dict.fromkeys(ref["counted"], True)}], what)
    folder = run / "run" / "iter_0000003" / "mp_rank_01"
    result = gradclip(
        "inspect", folder / FILE if given == "file" else folder, "--what", what, "--format", "json"
    )
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 3 and "covers mp_rank_01 only" in " ".join(doc["description"])
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL


def test_weights_and_the_save_folder(gradclip, run):
    expected = _expected(_references(run, 3), "weights")
    result = gradclip("inspect", run / "run", "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 3 and TRACKER in " ".join(doc["description"])
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected) and not any("_extra_state" in n for n in rows)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name


def test_never_reports_weights_or_moments_as_gradients(gradclip, run):
    auto = gradclip("inspect", run / "run", "--format", "json")
    assert auto.code == 0 and auto.json()["what"] == "exp_avg", auto.err
    grads = gradclip("inspect", run / "run" / "iter_0000002", "--what", "grads")
    one_line_exit_3(grads, "saves no gradients", "--what exp_avg")
    one_line_exit_3(gradclip("inspect", run / "run", "--key", "optimizer"), "--key")


def test_trend_over_the_save_folder(gradclip, run):
    assert len(list(_trended(gradclip, run, "grad_rms", _references))) == len(STEPS)


def _trended(gradclip, run: Path, what: str, references):
    """``trend`` over the run's save folder: one point a step, in order, each total that of
    ``references(run, step)``; yields (point, expected) for a test's further checks."""
    result = gradclip("trend", run / "run", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == list(STEPS)
    for point, step in zip(points, STEPS):
        expected = _expected(references(run, step), what)
        assert rel_err(point["total_norm"], norm(expected.values())) <= TOL
        yield point, expected


# --------------------------------------------------------------------- hostile copies


@pytest.fixture
def save(megatron_lm_runs, tmp_path) -> Path:
    target = tmp_path / "save"
    shutil.copytree(megatron_lm_runs["tp2"] / "run", target)
    return target


def _rank_file(save: Path, rank: int, step: int = 3) -> Path:
    return save / f"iter_{step:07d}" / f"mp_rank_{rank:02d}" / FILE


@pytest.mark.parametrize("text", ["../../elsewhere", "7", "iter_0000003", "\x00"])
def test_tracker_naming_no_folder_inside(gradclip, save, text):
    (save / TRACKER).write_text(text)
    one_line_exit_3(gradclip("inspect", save), TRACKER)


def test_truncated_rank_file(gradclip, save):
    file = _rank_file(save, 1)
    file.write_bytes(file.read_bytes()[:1000])
    one_line_exit_3(gradclip("inspect", save, "--what", "weights"), "mp_rank_01", FILE)


def test_a_missing_rank(gradclip, save):
    shutil.rmtree(save / "iter_0000003" / "mp_rank_01")
    one_line_exit_3(gradclip("inspect", save), "tensor_model_parallel_size 2", "mp_rank_00")


def test_a_gap_in_the_ranks(gradclip, save):
    folder = save / "iter_0000003"
    (folder / "mp_rank_01").rename(folder / "mp_rank_02")
    one_line_exit_3(gradclip("inspect", save), "mp_rank_01", "incomplete")


def test_a_rank_from_another_iteration(gradclip, save):
    shutil.copy(_rank_file(save, 1, 2), _rank_file(save, 1))
    one_line_exit_3(gradclip("inspect", save), "mp_rank_01", "iteration 2", "not one checkpoint")


def test_a_rank_of_another_model(gradclip, save, megatron_lm_runs):
    shutil.copy(_rank_file(megatron_lm_runs["fp32"] / "run", 0), _rank_file(save, 1))
    one_line_exit_3(gradclip("inspect", save), "mp_rank_01")


def test_a_layer_whose_split_cannot_be_told(gradclip, save, megatron_lm_runs):
    """A tensor-parallel model tensor under a name Megatron-core's layers do not use: its
    shards may be split or replicated, so no norm is given."""
    for rank in (0, 1):
        file = _rank_file(save, rank)
        code = (
            "import sys, torch; sys.path.insert(0, sys.argv[2]); "
            "sd = torch.load(sys.argv[1], weights_only=False); "
            "sd['model']['decoder.layers.0.mlp.adapter.weight'] = "
            "sd['model']['decoder.layers.0.mlp.linear_fc1.weight'].clone(); "
            "torch.save(sd, sys.argv[1])"
        )
        _with_megatron(megatron_lm_runs, code, file)
    one_line_exit_3(
        gradclip("inspect", save), "mp_rank_00", "adapter.weight", "cannot tell how it is split"
    )


def test_a_distributed_optimizers_file_beside_another_optimizer(gradclip, save):
    """A distrib_optim.pt beside a rank file whose optimizer is not the distributed one's
    (here empty): refused, naming it, never half read."""
    (_rank_file(save, 1).parent / "distrib_optim.pt").write_bytes(b"")
    one_line_exit_3(gradclip("inspect", save, "--what", "exp_avg"), "mp_rank_01", "distrib_optim")


@pytest.mark.parametrize("change", ["m[0] += 1.0", "m[0] = float('nan')"])
def test_an_fp32_master_that_is_not_the_models_tensor_is_refused(
    gradclip, save, megatron_lm_runs, change
):
    """Megatron copies each fp32 master (fp32_from_fp16_params), rounded, into the bf16
    model after every step: one that does not round to the model's tensor (changed, or a
    NaN the model does not hold) is refused in one line naming the file, never measured."""
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); "
        "sd = torch.load(sys.argv[1], weights_only=False); "
        "m = sd['optimizer']['fp32_from_fp16_params'][0][0].view(-1); "
        f"{change}; torch.save(sd, sys.argv[1])"
    )
    _with_megatron(megatron_lm_runs, code, _rank_file(save, 1))
    for what in ("weights", "exp_avg"):
        one_line_exit_3(
            gradclip("inspect", save, "--what", what),
            str(Path("mp_rank_01") / FILE),
            "fp32_from_fp16_params",
            "is not the model's tensor",
        )


def test_a_nan_in_the_master_and_the_model_alike_is_measured(gradclip, save, megatron_lm_runs):
    """A run that diverged saves the NaN in both copies (rounding keeps a NaN a NaN): the
    master is read and its NaN counted, never refused as a disagreement (master_copy's one
    NaN policy, as for torch_dist's fp32 main params)."""
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); "
        "sd = torch.load(sys.argv[1], weights_only=False); "
        "m = sd['optimizer']['fp32_from_fp16_params'][0][0]; "
        "w = next(t for t in sd['model'].values() if isinstance(t, torch.Tensor) "
        "and t.shape == m.shape and torch.equal(t, m.to(t.dtype))); "
        "m.view(-1)[0] = float('nan'); w.view(-1)[0] = float('nan'); "
        "torch.save(sd, sys.argv[1])"
    )
    _with_megatron(megatron_lm_runs, code, _rank_file(save, 1))
    result = gradclip("inspect", save, "--what", "weights", "--format", "json")
    assert result.code in (0, 1), result.err
    assert result.json()["nonfinite"]["nan"] == 1


def test_a_rank_file_that_runs_code_is_refused(gradclip, save, tmp_path):
    marker = tmp_path / "ran"
    torch.save({"iteration": 3, "args": RunsCode(marker), "model": {}}, _rank_file(save, 1))
    one_line_exit_3(gradclip("inspect", save), "mp_rank_01", "--trust-pickle")
    assert not marker.exists()


# --------------------------------------------------------------------- distributed optimizer

DISTRIB = "distrib_optim.pt"


def test_the_distributed_optimizer_fixture(distopt_runs):
    """Megatron's own layout in the fixture: several buckets, one distrib_optim.pt per rank,
    and on 1 rank padding between parameters and at the buckets' ends (the 2 ranks' shards
    happen to fall on 64-element boundaries)."""
    for name, run in distopt_runs.items():
        refs = _references(run, 3)
        assert all(ref["buckets"][0] >= 3 for ref in refs), name
        assert {ref["data_parallel"] for ref in refs} == {2 if "dp2" in name else 1}, name
        for r, ref in enumerate(refs):
            folder = run / "run" / "iter_0000003" / f"mp_rank_{r:02d}"
            state = torch.load(folder / DISTRIB, weights_only=True)
            assert state["buckets_coalesced"] is True and set(state) == {"buckets_coalesced", 0}
            ((dtypes, flat),) = state[0].items()
            assert dtypes == (torch.bfloat16, torch.float32)
            numel = sum(t.numel() for t in ref["weights"].values())
            assert numel <= flat["numel_unpadded"] <= ref["buffer_numel"][0]
            if name == "distopt":  # padding both inside and at the end of the buckets
                assert numel < flat["numel_unpadded"] < ref["buffer_numel"][0]


def test_the_distributed_optimizer_says_where_its_state_is(gradclip, distopt_runs):
    result = gradclip("inspect", distopt_runs["distopt"] / "run", "--format", "json")
    assert result.code == 0 and result.json()["what"] == "exp_avg", result.err
    doc = result.json()
    assert DISTRIB in doc["measured"]["evidence"]
    assert "checked against the model's tensors" in " ".join(doc["description"])


@pytest.fixture
def distopt_save(distopt_runs, tmp_path) -> Path:
    target = tmp_path / "save"
    shutil.copytree(distopt_runs["distopt_tp2"] / "run", target)
    return target


def _distrib(save: Path, rank: int, step: int = 3) -> Path:
    return _rank_file(save, rank, step).parent / DISTRIB


@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_one_distributed_optimizer_rank_alone(gradclip, distopt_runs, what):
    """mp_rank_01/ alone with its distrib_optim.pt: its shards and its replicas, each once."""
    run = distopt_runs["distopt_tp2"]
    ref = _references(run, 3)[1]
    expected = _expected([{**ref, "counted": dict.fromkeys(ref["counted"], True)}], what)
    folder = run / "run" / "iter_0000003" / "mp_rank_01"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 3 and "covers mp_rank_01 only" in " ".join(doc["description"])
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name


def test_a_missing_distrib_optim(gradclip, distopt_save):
    """A rank whose distrib_optim.pt is gone: the weights are still measured, saying why the
    moments are not; asked for, they are exit 3 naming the file."""
    _distrib(distopt_save, 1).unlink()
    auto = gradclip("inspect", distopt_save, "--format", "json")
    assert auto.code == 0 and auto.json()["what"] == "weights", auto.err
    assert "mp_rank_01/: its optimizer is Megatron's distributed optimizer" in " ".join(
        auto.json()["description"]
    )
    for what in QUANTITIES:
        result = gradclip("inspect", distopt_save, "--what", what)
        one_line_exit_3(result, "mp_rank_01/", DISTRIB, "there is none", "--what weights")


def test_truncated_distrib_optim(gradclip, distopt_save):
    file = _distrib(distopt_save, 1)
    file.write_bytes(file.read_bytes()[:2000])
    one_line_exit_3(gradclip("inspect", distopt_save), "mp_rank_01", DISTRIB)


def test_a_distrib_optim_of_another_step(gradclip, distopt_save):
    """Moments of iteration 2 beside iteration 3's model: its params are not the model's."""
    shutil.copy(_distrib(distopt_save, 0, 2), _distrib(distopt_save, 0))
    one_line_exit_3(gradclip("inspect", distopt_save), "mp_rank_00", DISTRIB, "whose")


def test_the_ranks_distrib_optims_swapped(gradclip, distopt_save):
    """Tensor-parallel ranks' states swapped: every shard must be its own rank's (the
    replicated ones alone would fit), else refused, never double counted."""
    a, b = _distrib(distopt_save, 0), _distrib(distopt_save, 1)
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)
    one_line_exit_3(gradclip("inspect", distopt_save), DISTRIB, "whose")


@pytest.mark.parametrize("key", ["exp_avg", "param"])
def test_a_non_zero_padding_element(gradclip, distopt_runs, tmp_path, key):
    """The elements between parameters (Megatron's own places, from its grad buffer) hold 0;
    one that does not means the layout is not the one Megatron wrote: refused."""
    distopt_save = tmp_path / "save"
    shutil.copytree(distopt_runs["distopt"] / "run", distopt_save)
    ref = _references(distopt_runs["distopt"], 3)[0]
    file = _distrib(distopt_save, 0)
    state = torch.load(file, weights_only=True)
    ((_, flat),) = state[0].items()
    padding = torch.ones(flat["numel_unpadded"], dtype=torch.bool)
    for start, end in ref["places"].values():
        padding[start:end] = False
    assert padding.any()
    for tensor in ("param", "exp_avg", "exp_avg_sq"):  # as Megatron wrote it: zeros
        assert not flat[tensor][padding].any()
    flat[key][int(padding.nonzero()[-1])] = 1.0
    torch.save(state, file)
    one_line_exit_3(gradclip("inspect", distopt_save), "mp_rank_00", DISTRIB, "padding")


@pytest.fixture(scope="module")
def distopt_odd_run(megatron_lm_runs, tmp_path_factory) -> Path:
    """The distributed optimizer on 2 data-parallel ranks (bf16, tied) in buckets of 1100
    elements: a bucket closes on a layer norm, so its length is no multiple of 64 and the
    next bucket starts off the 64-element grid in distrib_optim.pt's buckets side by side."""
    folder = tmp_path_factory.mktemp("megatron_lm_distopt_odd")
    return run_generator(
        megatron_lm_runs["python"],
        "megatron_lm_run.py",
        folder,
        2,
        "tied",
        "bf16",
        "distopt",
        "bucket=1100",
    )


@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
def test_buckets_whose_lengths_are_off_the_64_element_grid(gradclip, distopt_odd_run, what):
    """Each bucket's parameters are 64-aligned from the bucket's own start (Megatron pads
    each bucket's end), not from the buckets' lengths summed."""
    _same_places(distopt_odd_run)
    refs = _references(distopt_odd_run, 3)
    _inspected_as_loaded(gradclip, distopt_odd_run, 3, what, refs, layers=(0, 1))


def test_megatrons_places_are_the_moments(distopt_runs):
    """The fixture's flat tensors hold each parameter's state at Megatron's own places (the
    reference that the per-parameter checks above rest on)."""
    for run in distopt_runs.values():
        _same_places(run)


def _same_places(run: Path) -> None:
    for r, ref in enumerate(_references(run, 3)):
        folder = run / "run" / "iter_0000003" / f"mp_rank_{r:02d}"
        ((_, flat),) = torch.load(folder / DISTRIB, weights_only=True)[0].items()
        for name, (start, end) in ref["places"].items():
            assert torch.equal(
                flat["exp_avg"][start:end], ref["state"][name]["exp_avg"].reshape(-1)
            )


# --------------------------------------------------------------------- under torchrun


def test_two_ranks_print_the_one_process_report(megatron_lm_runs, tmp_path):
    run = megatron_lm_runs["tp2"]
    jobs = [
        {"args": ["inspect", str(run / "run"), "--what", what, "--format", fmt, "--no-progress"]}
        for what in (*QUANTITIES, "weights")
        for fmt in ("table", "json")
    ]
    jobs.append({"args": ["trend", str(run / "run"), "--what", "exp_avg", "--format", "json"]})
    same_under_torchrun(jobs, tmp_path)


# --------------------------------------------------------------------- pipeline stages

STAGE = "mp_rank_00_{:03d}"


@pytest.fixture(scope="module")
def pp_runs(megatron_lm_runs, tmp_path_factory) -> dict[str, Path]:
    """2 pipeline stages on 2 gloo ranks, trained through Megatron-core's own 1F1B schedule:
    fp32, 4 layers 2 a stage, the output layer untied (``"pp2"``); bf16, 3 layers, 1 on the
    first stage (``--decoder-first-pipeline-num-layers 1``), tied, so the last stage holds a
    copy of the embedding (``"pp2_tied"``); bf16, tied, with the distributed optimizer
    (``"pp2_distopt"``)."""
    python = megatron_lm_runs["python"]
    out = {}
    for name, extra in (
        ("pp2", ()),
        ("pp2_tied", ("tied", "bf16", "uneven")),
        ("pp2_distopt", ("tied", "bf16", "distopt")),
    ):
        folder = tmp_path_factory.mktemp(f"megatron_lm_{name}")
        out[name] = run_generator(python, "megatron_lm_run.py", folder, 2, "pp", *extra)
    return out


@pytest.fixture(scope="module", params=["pp2", "pp2_tied", "pp2_distopt"])
def pp_run(request, pp_runs) -> Path:
    return pp_runs[request.param]


def _global(ref: dict) -> dict:
    """A stage's reference under global layer names: Megatron's own layer objects give each
    local ``decoder.layers.i`` its ``layer_number`` (``layer_numbers[i]``, from 0)."""

    return _renamed(ref, lambda local: _by_layer_number(local, ref["layer_numbers"]))


def _by_layer_number(local: str, numbers: list[int]) -> str:
    """``decoder.layers.i...`` as ``decoder.layers.<numbers[i]>...``; other names as they are."""
    head, _, rest = local.partition("decoder.layers.")
    if head or not rest:
        return local
    index, _, tail = rest.partition(".")
    return f"decoder.layers.{numbers[int(index)]}.{tail}"


def _renamed(ref: dict, name) -> dict:
    """``ref`` with the names of its per-tensor entries given by ``name``, none two alike."""
    out = dict(ref)
    for key in ("weights", "masters", "state", "hyper", "counted"):
        if key in ref:
            renamed = {name(n): v for n, v in ref[key].items()}
            assert len(renamed) == len(ref[key])  # no two entries under one name
            out[key] = renamed
    return out


def _stage_refs(run: Path, step: int) -> list[dict]:
    """The ranks' references under global layer names, stage by stage (each stage's
    tensor-parallel ranks in order: Megatron's global ranks run tensor-parallel first)."""
    refs = [_global(ref) for ref in _references(run, step)]
    stages = [ref["stage"] for ref in refs]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    assert stages.count(0) == stages.count(1)
    return refs


def test_the_pipeline_fixture_numbers_layers_per_stage(pp_run):
    """Megatron's own files: one mp_rank_00_00S folder a stage, each numbering its layers
    from 0, while Megatron's layer objects know them by their global number."""
    folder = pp_run / "run" / "iter_0000003"
    assert sorted(p.name for p in folder.iterdir()) == [STAGE.format(0), STAGE.format(1)]
    refs = _references(pp_run, 3)
    first, last = refs[0]["layer_numbers"], refs[1]["layer_numbers"]
    assert first == list(range(len(first))) and last == list(range(len(first), len(first) + 2))
    assert "decoder.layers.0.input_layernorm.weight" in refs[1]["weights"]
    assert f"decoder.layers.{len(last)}.input_layernorm.weight" not in refs[1]["weights"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_every_quantity_of_the_stages_against_megatrons_load(gradclip, pp_run, step, what):
    refs = _stage_refs(pp_run, step)
    layers = [n for ref in refs for n in ref["layer_numbers"]]
    assert layers == list(range(len(layers)))  # global layers, whichever stage holds them
    _inspected_as_loaded(gradclip, pp_run, step, what, refs, layers)


def test_the_tied_copy_counts_once(gradclip, pp_runs):
    """Tied: the last stage's output_layer.weight is Megatron's shared copy of the embedding
    (not counted by its grad norm); untied, it is a parameter of its own."""
    for name, tied in (("pp2", False), ("pp2_tied", True), ("pp2_distopt", True)):
        first, ref = _references(pp_runs[name], 3)
        assert ref["counted"]["output_layer.weight"] is not tied
        if tied:  # the copy: the same weights, masters and moments as the embedding's
            embedding, copy = "embedding.word_embeddings.weight", "output_layer.weight"
            assert torch.equal(first["masters"][embedding], ref["masters"][copy])
            assert torch.equal(first["state"][embedding]["exp_avg"], ref["state"][copy]["exp_avg"])
        result = gradclip("inspect", pp_runs[name] / "run", "--format", "json")
        assert result.code == 0, result.err
        doc = result.json()
        names = {t["name"] for t in doc["tensors"]}
        assert ("output_layer.weight" in names) is not tied, name
        assert ("(tied): not counted" in " ".join(doc["description"])) is tied


@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_one_stage_alone(gradclip, pp_runs, what):
    """The last stage's folder alone: its layers under their global numbers, and the report
    says it covers that stage only."""
    run = pp_runs["pp2_tied"]
    ref = _stage_refs(run, 3)[1]
    expected = _expected([ref], what)
    del expected["output_layer.weight"]  # the tied copy, which Megatron's norm skips
    _folder_alone(
        gradclip,
        run / "run" / "iter_0000003" / STAGE.format(1),
        what,
        expected,
        {"decoder.layers.1", "decoder.layers.2"},
    )


def _folder_alone(gradclip, folder: Path, what: str, expected: dict, layers: set[str]) -> None:
    """One rank's folder of step 3 inspected alone: ``expected`` (name -> float64 tensor),
    those layers' groups, and the report saying it covers that folder only."""
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 3 and f"covers {folder.name} only" in " ".join(doc["description"])
    assert {t["name"] for t in doc["tensors"]} == set(expected)
    assert {g["name"] for g in doc["groups"]} >= layers
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL


def test_trend_over_the_pipelined_save_folder(gradclip, pp_runs):
    for point, expected in _trended(gradclip, pp_runs["pp2"], "update", _stage_refs):
        assert (
            rel_err(
                point["groups"]["decoder.layers.3"],
                norm(v for n, v in expected.items() if n.startswith("decoder.layers.3.")),
            )
            <= TOL
        )


@pytest.fixture
def pp_save(pp_runs, tmp_path) -> Path:
    target = tmp_path / "save"
    shutil.copytree(pp_runs["pp2"] / "run", target)
    return target


def _stage_file(save: Path, stage: int, step: int = 3) -> Path:
    return save / f"iter_{step:07d}" / STAGE.format(stage) / FILE


def _rewrite_args(megatron_lm_runs, file: Path, change: str) -> None:
    """Change a real stage file's args with Megatron's own classes (in its venv)."""
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); "
        "sd = torch.load(sys.argv[1], weights_only=False); a = sd['args']; "
        f"{change}; torch.save(sd, sys.argv[1])"
    )
    _with_megatron(megatron_lm_runs, code, file)


def _with_megatron(megatron_lm_runs, code: str, file: Path) -> str:
    """Run ``code`` on ``file`` in Megatron-LM's python, its checkout importable (argv 1
    the file, argv 2 the checkout); what it printed."""
    done = subprocess.run(
        [megatron_lm_runs["python"], "-c", code, str(file), os.environ["MEGATRON_LM_PATH"]],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_missing_stage(gradclip, pp_save):
    shutil.rmtree(pp_save / "iter_0000003" / STAGE.format(1))
    one_line_exit_3(gradclip("inspect", pp_save), "no mp_rank_00_001", "pipeline")


def test_a_stage_from_another_iteration(gradclip, pp_save):
    shutil.copy(_stage_file(pp_save, 1, 2), _stage_file(pp_save, 1))
    one_line_exit_3(
        gradclip("inspect", pp_save), "mp_rank_00_001", "iteration 2", "not one checkpoint"
    )


def test_a_truncated_stage_file(gradclip, pp_save):
    file = _stage_file(pp_save, 1)
    file.write_bytes(file.read_bytes()[:1000])
    one_line_exit_3(gradclip("inspect", pp_save, "--what", "weights"), "mp_rank_00_001", FILE)


def test_stages_that_disagree_on_the_pipeline_size(gradclip, pp_save, megatron_lm_runs):
    _rewrite_args(megatron_lm_runs, _stage_file(pp_save, 1), "a.pipeline_model_parallel_size = 3")
    one_line_exit_3(gradclip("inspect", pp_save), "mp_rank_00_001", "3 pipeline-parallel ranks")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            "a.virtual_pipeline_model_parallel_size = 2",
            ("holds one model", "virtual_pipeline_model_parallel_size 2"),
        ),
        ("a.decoder_first_pipeline_num_layers = 1", ("decoder layers [0, 1]", "1 layer(s)")),
        ("a.num_layers = 5", ("5 layers do not split evenly",)),
        ("del a.untie_embeddings_and_output_weights", ("untie_embeddings_and_output_weights",)),
        (
            "sd['model0'] = sd.pop('model'); sd['model1'] = dict(sd['model0'])",
            (
                "2 virtual pipeline chunk(s) (model0, model1)",
                "args set no virtual_pipeline_model_parallel_size",
            ),
        ),
    ],
)
def test_a_split_the_args_do_not_decide(gradclip, pp_save, megatron_lm_runs, change, words):
    """Virtual stages the files and args disagree on (the args say 2 a stage, the file holds
    one model; the file holds model0 and model1, the args say none), an uneven split the
    files do not hold, a layer count the stages cannot share, no word on tying: refused,
    naming the file, never guessed."""
    for stage in (0, 1):
        _rewrite_args(megatron_lm_runs, _stage_file(pp_save, stage), change)
    one_line_exit_3(gradclip("inspect", pp_save), "mp_rank_00_00", *words)


def test_two_processes_print_the_one_process_pipelined_report(pp_runs, tmp_path):
    jobs = [
        {"args": ["inspect", str(pp_runs[n] / "run"), "--what", w, "--format", f, "--no-progress"]}
        for n, w, f in (("pp2", "exp_avg", "table"), ("pp2_tied", "update", "json"))
    ]
    jobs.append({"args": ["trend", str(pp_runs["pp2"] / "run"), "--what", "grad_rms"]})
    same_under_torchrun(jobs, tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        "a.decoder_first_pipeline_num_layers = None; a.decoder_last_pipeline_num_layers = 2",
        "a.decoder_first_pipeline_num_layers = None; "
        "a.account_for_embedding_in_pipeline_split = True",
    ],
)
def test_other_args_that_give_the_same_split(gradclip, pp_runs, megatron_lm_runs, tmp_path, change):
    """1 + 2 layers said another way Megatron-core builds the same stages by (the last
    stage's count, or the embedding counted as a layer of the first): the same report."""
    save = tmp_path / "save"
    shutil.copytree(pp_runs["pp2_tied"] / "run", save)
    for stage in (0, 1):
        _rewrite_args(megatron_lm_runs, _stage_file(save, stage), change)
    before = gradclip("inspect", pp_runs["pp2_tied"] / "run", "--format", "json")
    after = gradclip("inspect", save, "--format", "json")
    assert after.code == 0, after.err
    assert after.json()["groups"] == before.json()["groups"]
    assert after.json()["total_norm"] == before.json()["total_norm"]


def test_a_split_the_files_do_not_hold(gradclip, pp_runs, megatron_lm_runs, tmp_path):
    """The loss counted as a layer of the last stage: 2 + 1 layers, but the files hold 1 + 2."""
    save = tmp_path / "save"
    shutil.copytree(pp_runs["pp2_tied"] / "run", save)
    change = (
        "a.decoder_first_pipeline_num_layers = None; a.account_for_loss_in_pipeline_split = True"
    )
    for stage in (0, 1):
        _rewrite_args(megatron_lm_runs, _stage_file(save, stage), change)
    one_line_exit_3(gradclip("inspect", save), "mp_rank_00_000", "decoder layers [0]", "2 layer")


# --------------------------------------------------------------------- tensor x pipeline parallel

TP_PP = [f"mp_rank_{t:02d}_{s:03d}" for s in (0, 1) for t in (0, 1)]


@pytest.fixture(scope="module")
def tp_pp_runs(megatron_lm_runs, tmp_path_factory) -> dict[str, Path]:
    """2 tensor-parallel ranks on each of 2 pipeline stages (4 gloo ranks, Megatron's
    ``mp_rank_0T_00S`` folders), trained through the 1F1B schedule as ``pp_runs``; bf16,
    4 layers, tied (the last stage's copy of the embedding is split across its two ranks as
    the embedding is): with the float16 optimizer (``"tp2_pp2"``) and the distributed one
    (``"tp2_pp2_distopt"``), its buckets closing at 2100 elements on the first stage, where
    a bucketed last stage (Megatron's DDP buckets none after the first) would be laid out
    otherwise."""
    python = megatron_lm_runs["python"]
    out = {}
    for name, extra in (("tp2_pp2", ()), ("tp2_pp2_distopt", ("distopt", "bucket=2100"))):
        folder = tmp_path_factory.mktemp(f"megatron_lm_{name}")
        out[name] = run_generator(
            python, "megatron_lm_run.py", folder, 4, "tp", "pp", "tied", "bf16", *extra
        )
    return out


@pytest.fixture(scope="module", params=["tp2_pp2", "tp2_pp2_distopt"])
def tp_pp_run(request, tp_pp_runs) -> Path:
    return tp_pp_runs[request.param]


def test_the_tensor_and_pipeline_fixture(tp_pp_run):
    """Megatron's own files: one folder a (tensor-parallel rank, stage), each stage's layers
    numbered from 0, its split tensors halved on each of its ranks."""
    folder = tp_pp_run / "run" / "iter_0000003"
    assert sorted(p.name for p in folder.iterdir()) == sorted(TP_PP)
    refs = _references(tp_pp_run, 3)
    assert [r["stage"] for r in refs] == [0, 0, 1, 1]
    assert [r["layer_numbers"] for r in refs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for stage in (refs[:2], refs[2:]):
        assert stage[0]["weights"].keys() == stage[1]["weights"].keys()
        assert any(not c for c in stage[1]["counted"].values())  # replicated ones
        assert any(c for c in stage[1]["counted"].values())  # split ones
    if "buckets" in refs[0]:  # the first stage bucketed, the last not (its copy apart)
        assert [r["buckets"] for r in refs] == [[3], [3], [2], [2]]
    copy = refs[2]["weights"]["output_layer.weight"]  # the tied copy, split as the embedding
    assert copy.shape == refs[0]["weights"]["embedding.word_embeddings.weight"].shape
    assert not refs[2]["counted"]["output_layer.weight"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_every_quantity_of_the_tensor_and_pipeline_ranks(gradclip, tp_pp_run, step, what):
    refs = _stage_refs(tp_pp_run, step)
    _inspected_as_loaded(gradclip, tp_pp_run, step, what, refs, layers=(0, 1, 2, 3))


def test_the_tensor_and_pipeline_report_says_what_it_holds(gradclip, tp_pp_runs):
    result = gradclip("inspect", tp_pp_runs["tp2_pp2"] / "run", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    said = " ".join(doc["description"])
    assert f"2 pipeline stages of 2 tensor-parallel rank(s) ({', '.join(TP_PP)})" in said
    assert "decoder layers 0-1 in mp_rank_00_000, 2-3 in mp_rank_00_001" in said
    assert "(tied): not counted" in said
    assert "replicated (counted once, from each stage's mp_rank_00_YYY" in said
    assert "output_layer.weight" not in {t["name"] for t in doc["tensors"]}
    assert [g["name"] for g in doc["groups"] if g["name"].startswith("decoder.layers.")] == [
        f"decoder.layers.{n}" for n in range(4)
    ]


@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_one_tensor_parallel_rank_of_a_stage_alone(gradclip, tp_pp_runs, what):
    """mp_rank_01_001 alone: its own shards of the last stage's layers (global 2 and 3),
    every one counted but the tied copy, and said to cover that folder only."""
    run = tp_pp_runs["tp2_pp2"]
    ref = _stage_refs(run, 3)[3]
    expected = _expected([{**ref, "counted": dict.fromkeys(ref["counted"], True)}], what)
    del expected["output_layer.weight"]
    _folder_alone(
        gradclip,
        run / "run" / "iter_0000003" / "mp_rank_01_001",
        what,
        expected,
        {"decoder.layers.2", "decoder.layers.3"},
    )


def test_trend_over_the_tensor_and_pipeline_save_folder(gradclip, tp_pp_run):
    for point, expected in _trended(gradclip, tp_pp_run, "grad_rms", _stage_refs):
        layer = norm(v for n, v in expected.items() if n.startswith("decoder.layers.2."))
        assert rel_err(point["groups"]["decoder.layers.2"], layer) <= TOL


def test_two_processes_print_the_one_process_tensor_and_pipeline_report(tp_pp_runs, tmp_path):
    jobs = [
        {
            "args": [
                "inspect",
                str(tp_pp_runs[n] / "run"),
                "--what",
                w,
                "--format",
                f,
                "--no-progress",
            ]
        }
        for n, w, f in (
            ("tp2_pp2", "exp_avg", "table"),
            ("tp2_pp2", "weights", "json"),
            ("tp2_pp2_distopt", "update", "json"),
        )
    ]
    jobs.append(
        {"args": ["trend", str(tp_pp_runs["tp2_pp2_distopt"] / "run"), "--what", "grad_rms"]}
    )
    same_under_torchrun(jobs, tmp_path)


@pytest.fixture
def tp_pp_save(tp_pp_runs, tmp_path) -> Path:
    target = tmp_path / "save"
    shutil.copytree(tp_pp_runs["tp2_pp2"] / "run", target)
    return target


def _tp_pp_file(save: Path, folder: str, step: int = 3) -> Path:
    return save / f"iter_{step:07d}" / folder / FILE


def test_a_missing_tensor_parallel_rank_of_a_stage(gradclip, tp_pp_save):
    shutil.rmtree(tp_pp_save / "iter_0000003" / "mp_rank_01_001")
    one_line_exit_3(
        gradclip("inspect", tp_pp_save), "no mp_rank_01_001", "2 tensor- x 2 pipeline-parallel"
    )


def test_a_stage_rank_from_another_iteration(gradclip, tp_pp_save):
    shutil.copy(
        _tp_pp_file(tp_pp_save, "mp_rank_01_001", 2), _tp_pp_file(tp_pp_save, "mp_rank_01_001")
    )
    one_line_exit_3(
        gradclip("inspect", tp_pp_save), "mp_rank_01_001", "iteration 2", "not one checkpoint"
    )


def test_a_rank_of_the_other_stage_in_its_place(gradclip, tp_pp_save):
    """mp_rank_01_000 holding the last stage's rank 1: not the first stage's tensors."""
    shutil.copy(
        _tp_pp_file(tp_pp_save, "mp_rank_01_001"), _tp_pp_file(tp_pp_save, "mp_rank_01_000")
    )
    one_line_exit_3(gradclip("inspect", tp_pp_save), "mp_rank_01_000", "not one model")


def test_a_truncated_rank_of_a_stage(gradclip, tp_pp_save):
    file = _tp_pp_file(tp_pp_save, "mp_rank_01_001")
    file.write_bytes(file.read_bytes()[:1000])
    one_line_exit_3(gradclip("inspect", tp_pp_save, "--what", "weights"), "mp_rank_01_001", FILE)


def test_ranks_that_disagree_on_the_tensor_parallel_size(gradclip, tp_pp_save, megatron_lm_runs):
    _rewrite_args(
        megatron_lm_runs,
        _tp_pp_file(tp_pp_save, "mp_rank_01_001"),
        "a.tensor_model_parallel_size = 4",
    )
    one_line_exit_3(gradclip("inspect", tp_pp_save), "mp_rank_01_001", "4 tensor-")


# --------------------------------------------------------------------- virtual pipeline

VP_LAYERS = [[[0], [2]], [[1], [3]]]  # each stage's chunks' layers, as Megatron numbers them


@pytest.fixture(scope="module")
def vp_runs(megatron_lm_runs, tmp_path_factory) -> dict[str, Path]:
    """2 pipeline stages of 2 virtual stages each (``--num-layers-per-virtual-pipeline-stage
    1``, 4 layers; 2 gloo ranks), trained through Megatron-core's interleaved schedule, each
    stage's file holding ``model0`` and ``model1``: fp32, untied (``"vp2"``); bf16 with
    fp32 masters, tied, so the last stage's last chunk holds a copy of the embedding
    (``"vp2_tied"``); as that with the distributed optimizer, buckets closing at 2100
    elements (``"vp2_distopt"``: distrib_optim.pt holds a grad buffer a chunk, the first
    stage's first bucketed, the others not)."""
    python = megatron_lm_runs["python"]
    out = {}
    for name, extra in (
        ("vp2", ()),
        ("vp2_tied", ("tied", "bf16")),
        ("vp2_distopt", ("tied", "bf16", "distopt", "bucket=2100")),
    ):
        folder = tmp_path_factory.mktemp(f"megatron_lm_{name}")
        out[name] = run_generator(python, "megatron_lm_run.py", folder, 2, "pp", "vp", *extra)
    return out


@pytest.fixture(scope="module", params=["vp2", "vp2_tied", "vp2_distopt"])
def vp_run(request, vp_runs) -> Path:
    return vp_runs[request.param]


def _chunked(ref: dict) -> dict:
    """A virtual pipeline stage's reference under global names: each chunk's entries
    (``model<i>.<name>``, the chunk's key in the file) renamed, ``decoder.layers.j`` by the
    chunk's own layers' ``layer_number`` (``layer_numbers[i][j]``)."""

    def name(qualified: str) -> str:
        key, _, local = qualified.partition(".")
        return _by_layer_number(local, ref["layer_numbers"][int(key[len("model") :])])

    return _renamed(ref, name)


def _chunk_refs(run: Path, step: int) -> list[dict]:
    refs = [_chunked(ref) for ref in _references(run, step)]
    stages = [ref["stage"] for ref in refs]  # a rank a stage, or 2 tensor-parallel ranks a stage
    assert stages in ([0, 1], [0, 0, 1, 1])
    return refs


def _keys(megatron_lm_runs, file: Path) -> list[str]:
    """The top-level keys of a real stage file, read with Megatron's own classes."""
    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[2]); "
        "print(json.dumps(sorted(torch.load(sys.argv[1], weights_only=False))))"
    )
    return json.loads(_with_megatron(megatron_lm_runs, code, file))


def test_the_virtual_pipeline_fixture(vp_run, megatron_lm_runs):
    """Megatron's own files: one folder a stage, each holding model0 and model1 (no model),
    each chunk numbering its layer from 0, while Megatron's layer objects know stage 0's
    chunks as layers 0 and 2 and stage 1's as 1 and 3."""
    folder = vp_run / "run" / "iter_0000003"
    assert sorted(p.name for p in folder.iterdir()) == [STAGE.format(0), STAGE.format(1)]
    refs = _references(vp_run, 3)
    assert [r["layer_numbers"] for r in refs] == VP_LAYERS
    for stage, ref in enumerate(refs):
        keys = _keys(megatron_lm_runs, folder / STAGE.format(stage) / FILE)
        assert {"model0", "model1"} <= set(keys) and "model" not in keys
        for chunk in ("model0", "model1"):
            assert f"{chunk}.decoder.layers.0.input_layernorm.weight" in ref["weights"]
            assert f"{chunk}.decoder.layers.1.input_layernorm.weight" not in ref["weights"]
    assert "model0.embedding.word_embeddings.weight" in refs[0]["weights"]
    assert "model1.output_layer.weight" in refs[1]["weights"]
    if "distopt" in vp_run.name:  # distrib_optim.pt: a grad buffer a chunk
        for stage in (0, 1):
            state = torch.load(folder / STAGE.format(stage) / DISTRIB, weights_only=True)
            assert set(state) == {"buckets_coalesced", 0, 1}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_every_quantity_of_the_virtual_pipeline(gradclip, vp_run, step, what):
    """Every quantity, tensor and layer of the interleaved stages against Megatron's own
    load: the optimizer state mapped over the chunks in its param groups' order."""
    refs = _chunk_refs(vp_run, step)
    _inspected_as_loaded(gradclip, vp_run, step, what, refs, layers=(0, 1, 2, 3))


def test_the_virtual_pipeline_report_says_what_it_holds(gradclip, vp_runs):
    for name, tied in (("vp2", False), ("vp2_tied", True)):
        result = gradclip("inspect", vp_runs[name] / "run", "--format", "json")
        assert result.code == 0, result.err
        doc = result.json()
        said = " ".join(doc["description"])
        assert (
            "decoder layers 0 (model0), 2 (model1) in mp_rank_00_000; "
            "1 (model0), 3 (model1) in mp_rank_00_001: each virtual pipeline chunk" in said
        )
        assert "virtual_pipeline_model_parallel_size 2" in said
        assert ("(tied): not counted" in said) is tied
        assert ("output_layer.weight" in {t["name"] for t in doc["tensors"]}) is not tied
        assert [g["name"] for g in doc["groups"] if g["name"].startswith("decoder.layers.")] == [
            f"decoder.layers.{n}" for n in range(4)
        ]


@pytest.mark.parametrize("what", [*QUANTITIES, "weights"])
def test_one_virtual_pipeline_stage_alone(gradclip, vp_runs, what):
    """The last stage's folder alone: its chunks' layers under their global numbers (1 and
    3), the tied copy in its last chunk left out."""
    run = vp_runs["vp2_tied"]
    expected = _expected([_chunk_refs(run, 3)[1]], what)
    del expected["output_layer.weight"]  # the tied copy, which Megatron's norm skips
    _folder_alone(
        gradclip,
        run / "run" / "iter_0000003" / STAGE.format(1),
        what,
        expected,
        {"decoder.layers.1", "decoder.layers.3"},
    )


def test_trend_over_the_virtual_pipeline_save_folder(gradclip, vp_runs):
    for point, expected in _trended(gradclip, vp_runs["vp2"], "update", _chunk_refs):
        layer = norm(v for n, v in expected.items() if n.startswith("decoder.layers.2."))
        assert rel_err(point["groups"]["decoder.layers.2"], layer) <= TOL


def test_other_args_that_give_the_same_virtual_split(gradclip, vp_runs, megatron_lm_runs, tmp_path):
    """2 layers on the first stage said as an uneven first stage (Megatron-core's other
    offset rule, which ``--num-virtual-stages-per-pipeline-rank`` allows): the same chunks,
    the same report."""
    save = tmp_path / "save"
    shutil.copytree(vp_runs["vp2"] / "run", save)
    for stage in (0, 1):
        _rewrite_args(
            megatron_lm_runs, _stage_file(save, stage), "a.decoder_first_pipeline_num_layers = 2"
        )
    before = gradclip("inspect", vp_runs["vp2"] / "run", "--format", "json")
    after = gradclip("inspect", save, "--format", "json")
    assert after.code == 0, after.err
    assert after.json()["groups"] == before.json()["groups"]
    assert after.json()["total_norm"] == before.json()["total_norm"]


_FC1 = "sd['model1']['decoder.layers.0.mlp.linear_fc1.weight']"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("del sd['model1']", ("1 virtual pipeline chunk(s) (model0)", "incomplete")),
        ("sd['model'] = sd['model0']", ("both a model and 2 virtual pipeline chunk(s)",)),
        (f"{_FC1} = {_FC1}[:-1].clone()", ("cannot map optimizer state",)),
        (
            "sd['model1']['decoder.layers.1.input_layernorm.weight'] = "
            "sd['model1']['decoder.layers.0.input_layernorm.weight']",
            ("decoder layers [0, 1] in model1", "pipeline stage 1's chunk model1 1 layer(s)"),
        ),
    ],
)
def test_a_damaged_virtual_pipeline_stage(
    gradclip, vp_runs, megatron_lm_runs, tmp_path, change, words
):
    """The last stage's file changed with Megatron's own classes: a chunk missing, a model
    beside the chunks, a model1 tensor of another shape than its optimizer state, a chunk
    holding a layer too many: refused, one line naming it."""
    save = tmp_path / "save"
    shutil.copytree(vp_runs["vp2"] / "run", save)
    _rewrite_args(megatron_lm_runs, _stage_file(save, 1), change)
    one_line_exit_3(gradclip("inspect", save, "--what", "weights"), "mp_rank_00_001", *words)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("a.virtual_pipeline_model_parallel_size = 4", ("size 4", "incomplete")),
        ("a.num_layers = 6", ("3 layers do not split into 2 chunks",)),
    ],
)
def test_virtual_pipeline_args_the_files_do_not_fit(
    gradclip, vp_runs, megatron_lm_runs, tmp_path, change, words
):
    """Both stages' args changed: 4 chunks a stage where the files hold 2, 6 layers that 2
    stages of 2 chunks cannot share: refused, naming the first stage's file."""
    save = tmp_path / "save"
    shutil.copytree(vp_runs["vp2"] / "run", save)
    for stage in (0, 1):
        _rewrite_args(megatron_lm_runs, _stage_file(save, stage), change)
    one_line_exit_3(gradclip("inspect", save, "--what", "weights"), "mp_rank_00_000", *words)


def test_two_processes_print_the_one_process_virtual_pipeline_report(vp_runs, tmp_path):
    jobs = [
        {"args": ["inspect", str(vp_runs[n] / "run"), "--what", w, "--format", f, "--no-progress"]}
        for n, w, f in (("vp2", "exp_avg", "table"), ("vp2_distopt", "update", "json"))
    ]
    jobs.append({"args": ["trend", str(vp_runs["vp2_tied"] / "run"), "--what", "grad_rms"]})
    same_under_torchrun(jobs, tmp_path)


@pytest.fixture(scope="module")
def vp_tp_run(megatron_lm_runs, tmp_path_factory) -> Path:
    """2 tensor-parallel ranks on each of 2 pipeline stages of 2 virtual stages each (4 gloo
    ranks, ``mp_rank_0T_00S`` folders, each file ``model0`` and ``model1``), fp32."""
    folder = tmp_path_factory.mktemp("megatron_lm_vp_tp")
    return run_generator(megatron_lm_runs["python"], "megatron_lm_run.py", folder, 4,
                         "tp", "pp", "vp")


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update", "weights"])
def test_every_quantity_of_the_tensor_parallel_virtual_pipeline(gradclip, vp_tp_run, step, what):
    """Virtual stages over tensor-parallel ranks: each chunk's split tensors its ranks'
    shards side by side, every layer by its global number, against Megatron's own load."""
    refs = _chunk_refs(vp_tp_run, step)
    assert [r["stage"] for r in refs] == [0, 0, 1, 1]
    _inspected_as_loaded(gradclip, vp_tp_run, step, what, refs, layers=(0, 1, 2, 3))
