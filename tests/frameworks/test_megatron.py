"""Megatron ``torch_dist``: real Megatron-core runs on 1 and 2 gloo ranks (``megatron_run.py``).

References never go through gradclip: Megatron-core's own
``dist_checkpointing.load`` reads each step back into a fresh model's and
optimizer's sharded state dict (in the frameworks venv); its stacked layer
tensors are split here with plain indexing, and the moments' bias
corrections and updates computed in float64.
"""

from __future__ import annotations

import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import rel_err

from .support import (
    QUANTITIES,
    TOL,
    RunsCode,
    matches_reference,
    norm,
    one_line_exit_3,
    same_under_torchrun,
    skip_without_frameworks,
)

skip_without_frameworks()

STEPS = (1, 2, 3)
TRACKER = "latest_checkpointed_iteration.txt"


def _reference(run: Path, step: int) -> dict:
    return torch.load(run / "reference" / f"iter_{step}.pt", weights_only=True)


def _weights(ref: dict) -> dict[str, torch.Tensor]:
    """Model name (a stacked tensor's layer by its number) -> the weight Megatron loaded."""
    return {name: ref[f"model.{key}"] for key, name in ref["model_names"].items()}


def _measured(ref: dict, what: str) -> dict[str, torch.Tensor]:
    group = "optimizer.param_groups.0."  # hyperparameters as Megatron loaded them
    beta1, beta2 = ref[f"{group}betas.0"], ref[f"{group}betas.1"]
    lr, eps = ref[f"{group}lr"], ref[f"{group}eps"]
    step = float(ref["optimizer.state.common_step"])
    out = {}
    for i, name in enumerate(ref["param_names"]):
        if f"optimizer.state.{i}.exp_avg" not in ref:  # tensor parallel: another's replica
            continue
        m = ref[f"optimizer.state.{i}.exp_avg"].double() / (1 - beta1**step)
        v = ref[f"optimizer.state.{i}.exp_avg_sq"].double() / (1 - beta2**step)
        out[name] = {"exp_avg": m, "grad_rms": v.sqrt(), "update": lr * m / (v.sqrt() + eps)}[what]
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def run(request, megatron_runs) -> Path:
    return megatron_runs[request.param]


def test_the_fixture_is_megatrons_layout(run):
    folder = run / "run" / "iter_0000002"
    assert (run / "run" / TRACKER).read_text() == "3"
    assert '"sharded_backend": "torch_dist"' in (folder / "metadata.json").read_text()
    with pytest.raises(Exception, match="Namespace"):  # args: not weights-only loadable
        torch.load(folder / "common.pt", weights_only=True)
    assert b"all_local_plans" in (folder / ".metadata").read_bytes()


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_megatrons_load(gradclip, run, step, what):
    ref = _reference(run, step)
    expected = _measured(ref, what)
    weights = _weights(ref)
    result = gradclip(
        "inspect", run / "run" / f"iter_{step:07d}", "--what", what, "--format", "json"
    )
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("megatron", step, what)
    matches_reference(doc, expected, weights)
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):  # each stacked layer a group of its own
        members = [n for n in expected if n.startswith(f"decoder.layers.{layer}.")]
        assert (
            members
            and rel_err(
                groups[f"decoder.layers.{layer}"]["norm"], norm(expected[n] for n in members)
            )
            <= TOL
        )


def test_weights_and_the_save_folder(gradclip, run):
    weights = _weights(_reference(run, 3))
    result = gradclip("inspect", run / "run", "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 3 and TRACKER in " ".join(doc["description"])
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([weights[name]])) <= TOL, name
        assert row["shape"] == list(weights[name].shape)


def test_a_layout_built_on_megatrons_folders_reads_them_under_its_own_name(run):
    """``open_dist_ckpt`` (as NeMo 2's ``weights/`` would use it): the caller's kind and
    title, the tensors and moments Megatron's own layout reads."""
    from gradclip_cli.source.layouts import megatron

    folder = run / "run" / "iter_0000002"
    own = megatron.open(folder, key=None, trust_pickle=False, verify=False)
    other = megatron.open_dist_ckpt(
        folder, folder, None, kind="nemo", title="NeMo 2 checkpoint's weights/",
        trust_pickle=False, verify=False,
    )
    assert (own.kind, other.kind) == ("megatron", "nemo")
    assert other.description[0].startswith("NeMo 2 checkpoint's weights/ at iteration 2: ")
    assert other.description[0].split(": ", 1)[1] == own.description[0].split(": ", 1)[1]
    assert other.evidence == own.evidence and other.files == own.files
    assert other.weights.keys() == own.weights.keys()
    for name, tensor in other.weights.items():
        assert torch.equal(tensor.read(), own.weights[name].read()), name
    assert other.optimizers[0].state.keys() == own.optimizers[0].state.keys()


def test_never_reports_weights_or_moments_as_gradients(gradclip, run):
    auto = gradclip("inspect", run / "run" / "iter_0000002", "--format", "json")
    assert auto.code == 0 and auto.json()["what"] == "exp_avg", auto.err
    grads = gradclip("inspect", run / "run" / "iter_0000002", "--what", "grads")
    one_line_exit_3(grads, "saves no gradients", "--what exp_avg")
    one_line_exit_3(gradclip("inspect", run / "run", "--key", "optimizer"), "--key")


def test_trend_over_the_save_folder(gradclip, run):
    result = gradclip("trend", run / "run", "--what", "grad_rms", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == list(STEPS)
    for point, step in zip(points, STEPS):
        expected = _measured(_reference(run, step), "grad_rms")
        assert rel_err(point["total_norm"], norm(expected.values())) <= TOL


@pytest.mark.parametrize("what", QUANTITIES)
@pytest.mark.parametrize("name,ranks", [("tp2", 2), ("tp2pp2", 4)])
def test_tensor_parallel_shards_against_megatrons_load(gradclip, megatron_runs, what, name, ranks):
    """TP=2, alone and on each of 2 pipeline stages: Megatron splits the matrices across the
    ranks' files; each rank's reference holds its own shards of its own stage's tensors (a
    replicated tensor on its main replica only), so the full tensor's norm is the norm of
    the ranks' pieces together, and every layer is on one stage."""
    run = megatron_runs[name]
    pieces: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, list[torch.Tensor]] = {}
    for rank in range(ranks):
        ref = torch.load(run / "reference" / f"iter_3.rank{rank}.pt", weights_only=True)
        present = [
            i for i, _ in enumerate(ref["param_names"]) if f"optimizer.state.{i}.exp_avg" in ref
        ]
        names = [ref["param_names"][i] for i in present]
        sub = {
            k: v
            for k, v in ref.items()
            if not k.startswith("optimizer.state.") or k == "optimizer.state.common_step"
        }
        for j, i in enumerate(present):
            for moment in ("exp_avg", "exp_avg_sq"):
                sub[f"optimizer.state.{j}.{moment}"] = ref[f"optimizer.state.{i}.{moment}"]
        sub["param_names"] = names
        for name, value in _measured(sub, what).items():
            pieces.setdefault(name, []).append(value)
        for key, name in ref["model_names"].items():
            if f"model.{key}" in ref:
                weights.setdefault(name, []).append(ref[f"model.{key}"])
    result = gradclip("inspect", run / "run", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(pieces)
    split = [n for n, p in pieces.items() if len(p) == 2]
    assert any("linear_fc1.weight" in n for n in split)  # the fixture is tensor parallel
    assert {g["name"] for g in doc["groups"]} >= {"decoder.layers.0", "decoder.layers.1"}
    for name, row in rows.items():
        assert rel_err(row["norm"], norm(pieces[name])) <= TOL, name
        assert rel_err(row["ratio"], norm(pieces[name]) / norm(weights[name])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(t for p in pieces.values() for t in p)) <= TOL


# --------------------------------------------------------------------- hostile copies


def _copied(run: Path, tmp_path: Path) -> Path:
    """A private copy of ``run``'s save folder, to damage."""
    target = tmp_path / "save"
    shutil.copytree(run / "run", target)
    return target


@pytest.fixture
def save(run, tmp_path) -> Path:
    return _copied(run, tmp_path)


@pytest.mark.parametrize("text", ["../../elsewhere", "7", "iter_0000003", "\x00"])
def test_tracker_naming_no_folder_inside(gradclip, save, text):
    (save / TRACKER).write_text(text)
    one_line_exit_3(gradclip("inspect", save), TRACKER)


def test_tracker_linked_from_outside_is_refused(gradclip, save, tmp_path):
    """A tracker that names a real iteration, but lives outside the folder: small files
    are read only inside it (docs/reference/contract.md, "Safety")."""
    outside = tmp_path / "tracker-elsewhere"
    outside.write_text((save / TRACKER).read_text())
    (save / TRACKER).unlink()
    (save / TRACKER).symlink_to(outside)
    one_line_exit_3(gradclip("inspect", save), TRACKER, "outside")


def test_common_that_runs_code_is_refused(gradclip, save, tmp_path):
    marker = tmp_path / "ran"
    common = save / "iter_0000003" / "common.pt"
    torch.save({"iteration": 3, "args": RunsCode(marker)}, common)
    one_line_exit_3(gradclip("inspect", save), "common.pt", "--trust-pickle")
    assert not marker.exists()


def test_metadata_that_runs_code_is_refused(gradclip, save, tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "ran"
    meta = Metadata(state_dict_metadata={}, storage_meta=RunsCode(marker))
    (save / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(meta))
    one_line_exit_3(gradclip("inspect", save), "refused", "--trust-pickle", ".metadata")
    assert not marker.exists()


def test_truncated_chunk_file(gradclip, save):
    shard = sorted((save / "iter_0000003").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    one_line_exit_3(gradclip("inspect", save, "--what", "update"), shard.name)


def test_other_sharded_backend(gradclip, save):
    (save / "iter_0000003" / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    one_line_exit_3(gradclip("inspect", save / "iter_0000003"), "zarr", "torch_dist")


# --------------------------------------------------------------------- under torchrun


def test_two_ranks_print_the_one_process_report(megatron_runs, tmp_path):
    run = megatron_runs[2]
    jobs = [
        {"args": ["inspect", str(run / "run"), "--what", what, "--format", fmt, "--no-progress"]}
        for what in (*QUANTITIES, "weights")
        for fmt in ("table", "json")
    ]
    jobs.append({"args": ["trend", str(run / "run"), "--what", "exp_avg", "--format", "json"]})
    same_under_torchrun(jobs, tmp_path)


# --------------------------------------------------------------------- distributed optimizer


def test_the_distributed_optimizer_fixture(megatron_distopt_run):
    """Megatron-LM's default for the distributed optimizer under torch_dist: the state as
    flat grad-buffer buckets (several here), not by parameter."""
    folder = megatron_distopt_run / "run" / "iter_0000003"
    assert _reference(megatron_distopt_run, 3)["optimizer.param_state_sharding_type"] == (
        "dp_reshardable"
    )
    metadata = (folder / ".metadata").read_bytes()
    assert b"optimizer.distributed.dp_group_idx_0.gbuf_idx_0" in metadata
    assert b"bucket_idx_2.exp_avg" in metadata and b"optimizer.state.exp_avg" not in metadata


def _distributed_measured(ref: dict, what: str) -> dict[str, torch.Tensor]:
    """Each parameter's quantity from the moments the distributed optimizer holds after its
    own load of the buckets (``megatron_run.py``'s ``distopt.*``), in float64."""
    beta1, beta2 = ref["distopt.beta1"], ref["distopt.beta2"]
    lr, eps, step = ref["distopt.lr"], ref["distopt.eps"], float(ref["distopt.step"])
    out = {}
    for key in ref:
        if key.startswith("distopt.") and key.endswith(".exp_avg"):
            name = key[len("distopt.") : -len(".exp_avg")]
            m = ref[key].double() / (1 - beta1**step)
            v = ref[f"distopt.{name}.exp_avg_sq"].double() / (1 - beta2**step)
            quantities = {"exp_avg": m, "grad_rms": v.sqrt(), "update": lr * m / (v.sqrt() + eps)}
            out[name] = quantities[what]
    return out


@pytest.mark.parametrize("step", STEPS)
def test_the_distributed_optimizers_weights_against_megatrons_load(
    gradclip, megatron_distopt_run, step
):
    weights = _weights(_reference(megatron_distopt_run, step))
    folder = megatron_distopt_run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (step, "weights")
    assert rel_err(doc["total_norm"], norm(weights.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([weights[name]])) <= TOL, name
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):
        members = [w for n, w in weights.items() if n.startswith(f"decoder.layers.{layer}.")]
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members)) <= TOL


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_the_distributed_optimizers_moments_against_megatrons_load(
    gradclip, megatron_distopt_run, step, what
):
    """Each parameter's moments cut out of the buckets, against the state Megatron's own
    distributed optimizer holds once it has loaded them."""
    ref = _reference(megatron_distopt_run, step)
    expected = _distributed_measured(ref, what)
    weights = _weights(ref)
    folder = megatron_distopt_run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (step, what)
    assert "dp_reshardable buckets" in " ".join(doc["description"])
    assert set(expected) == set(weights)  # every parameter has its moments
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert row["shape"] == list(weights[name].shape)
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        assert rel_err(row["ratio"], norm([expected[name]]) / norm([weights[name]])) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):  # each stacked layer a group of its own
        members = [t for n, t in expected.items() if n.startswith(f"decoder.layers.{layer}.")]
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members)) <= TOL


@pytest.mark.parametrize("what", QUANTITIES)
def test_buckets_whose_lengths_are_off_the_64_element_grid(
    gradclip, megatron_distopt_odd_run, what
):
    """Buckets of 1100 elements close on a layer norm: their lengths are no multiple of 64,
    and each bucket's parameters are 64-aligned from its own start (Megatron pads the
    bucket's end), not from the buckets' lengths summed."""
    run = megatron_distopt_odd_run
    meta = pickle.loads((run / "run" / "iter_0000003" / ".metadata").read_bytes())
    sizes = [v.size[0] for k, v in meta.state_dict_metadata.items() if k.endswith(".param")]
    assert len(sizes) > 3 and any(n % 64 for n in sizes[:-1])
    expected = _distributed_measured(_reference(run, 3), what)
    result = gradclip("inspect", run / "run", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name


def test_auto_measures_the_distributed_optimizers_first_moment(gradclip, megatron_distopt_run):
    result = gradclip("inspect", megatron_distopt_run / "run", "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["what"] == "exp_avg"


def test_trend_over_the_distributed_optimizers_save_folder(gradclip, megatron_distopt_run):
    run = megatron_distopt_run / "run"
    result = gradclip("trend", run, "--what", "grad_rms", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == list(STEPS)
    for point, step in zip(points, STEPS):
        expected = _distributed_measured(_reference(megatron_distopt_run, step), "grad_rms")
        assert rel_err(point["total_norm"], norm(expected.values())) <= TOL


@pytest.fixture
def distopt_save(megatron_distopt_run, tmp_path) -> Path:
    return _copied(megatron_distopt_run, tmp_path)


def _rewrite_metadata(folder: Path, rename) -> None:
    """Rewrite a real ``.metadata``: each key through ``rename`` (None drops it)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = pickle.loads((folder / ".metadata").read_bytes())  # the fixture's own: trusted
    meta.state_dict_metadata = {
        rename(k): v for k, v in meta.state_dict_metadata.items() if rename(k) is not None
    }
    meta.storage_data = {
        MetadataIndex(rename(i.fqn), i.offset, i.index): v
        for i, v in meta.storage_data.items()
        if rename(i.fqn) is not None
    }
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def test_a_missing_bucket(gradclip, distopt_save):
    _rewrite_metadata(distopt_save / "iter_0000003", lambda k: None if ".bucket_idx_2." in k else k)
    result = gradclip("inspect", distopt_save, "--what", "exp_avg")
    one_line_exit_3(result, ".metadata", "buckets", "laid out")


def _swapped(a: str, b: str):
    """A key renaming that swaps the parts ``a`` and ``b``."""

    def rename(key):
        if a in key:
            return key.replace(a, b)
        return key.replace(b, a) if b in key else key

    return rename


def test_buckets_whose_sizes_do_not_fit_the_layout(gradclip, distopt_save):
    rename = _swapped(".bucket_idx_0.", ".bucket_idx_1.")
    _rewrite_metadata(distopt_save / "iter_0000003", rename)
    result = gradclip("inspect", distopt_save, "--what", "update")
    one_line_exit_3(result, ".metadata", "Megatron's layout")


def test_a_bucket_of_another_step(gradclip, distopt_save):
    """Step 2's bucket chunks in step 3's files: their params are not the weights."""
    new, old = distopt_save / "iter_0000003", distopt_save / "iter_0000002"
    for shard in sorted(new.glob("__1_*.distcp")):  # the second rank's: buckets only
        shutil.copy(old / shard.name, shard)
    result = gradclip("inspect", distopt_save, "--what", "grad_rms")
    one_line_exit_3(result, "__1_", ".distcp", "is not its weight")


@pytest.mark.parametrize("what", ["weights", "exp_avg"])
def test_a_truncated_bucket_file(gradclip, distopt_save, what):
    shard = sorted((distopt_save / "iter_0000003").glob("__1_*.distcp"))[-1]  # buckets only
    shard.write_bytes(shard.read_bytes()[:100])
    one_line_exit_3(gradclip("inspect", distopt_save, "--what", what), shard.name, "truncated")


def test_two_ranks_print_the_one_process_distributed_optimizer_report(
    megatron_distopt_run, tmp_path
):
    run = megatron_distopt_run / "run"
    jobs = [
        {"args": ["inspect", str(run), "--what", what, "--format", fmt, "--no-progress"]}
        for what in (*QUANTITIES, "weights")
        for fmt in ("table", "json")
    ]
    jobs.append({"args": ["trend", str(run), "--what", "update", "--format", "json"]})
    same_under_torchrun(jobs, tmp_path)


# ------------------------------------------------ distributed optimizer, tensor parallel


def _tensor_parallel_distributed(
    run: Path, step: int, what: str, ranks: int = 2
) -> tuple[dict, dict]:
    """Per parameter, the pieces of its quantity and of its weight from the ranks'
    references: each rank's moments as its distributed optimizer holds them after its own
    load (its shards), a tensor taken from a rank only where that rank holds its main
    replica (a replicated one from rank 0 alone), in float64."""
    pieces: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, list[torch.Tensor]] = {}
    for rank in range(ranks):
        ref = torch.load(run / "reference" / f"iter_{step}.rank{rank}.pt", weights_only=True)
        measured = _distributed_measured(ref, what)
        for key, name in ref["model_names"].items():
            if f"model.{key}" in ref:
                pieces.setdefault(name, []).append(measured[name])
                weights.setdefault(name, []).append(ref[f"model.{key}"])
    return pieces, weights


def test_the_tensor_parallel_distributed_optimizer_fixture(megatron_distopt_tp_run):
    meta = pickle.loads(
        (megatron_distopt_tp_run / "run" / "iter_0000003" / ".metadata").read_bytes()
    )
    keys = list(meta.state_dict_metadata)
    assert any(k.startswith("optimizer.distributed.dp_group_idx_1.gbuf_idx_0") for k in keys)
    assert len(meta.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"].chunks) == 4
    ref = torch.load(
        megatron_distopt_tp_run / "reference" / "iter_3.rank1.pt", weights_only=True
    )
    assert ref["distopt.decoder.layers.0.mlp.linear_fc2.weight.exp_avg"].shape == (16, 32)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
@pytest.mark.parametrize(
    "fixture,ranks", [("megatron_distopt_tp_run", 2), ("megatron_distopt_tp_pp_run", 4)]
)
def test_the_tensor_parallel_distributed_optimizers_moments_against_megatrons_load(
    gradclip, request, fixture, ranks, step, what
):
    """TP=2 with the distributed optimizer, alone and on each of 2 pipeline stages: each
    model-parallel rank's buckets (``dp_group_idx_N``, N = stage * 2 + tensor-parallel rank)
    cut into its shards, against the state each rank's own distributed optimizer holds once
    it has loaded them."""
    run = request.getfixturevalue(fixture)
    pieces, weights = _tensor_parallel_distributed(run, step, what, ranks)
    folder = run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("megatron", step, what)
    assert f"over {ranks} model-parallel ranks" in " ".join(doc["description"])
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(pieces)
    assert any(len(p) == 2 for p in pieces.values())  # split tensors: a shard per rank
    assert any(len(p) == 1 for p in pieces.values())  # replicated ones, counted once
    for name, row in rows.items():
        assert math.prod(row["shape"]) == sum(w.numel() for w in weights[name]), name
        assert rel_err(row["norm"], norm(pieces[name])) <= TOL, name
        assert rel_err(row["ratio"], norm(pieces[name]) / norm(weights[name])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(t for p in pieces.values() for t in p)) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):  # each stacked layer a group of its own
        members = [
            t for n, p in pieces.items() if n.startswith(f"decoder.layers.{layer}.") for t in p
        ]
        assert members
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members)) <= TOL


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_the_pipeline_parallel_distributed_optimizers_moments_against_megatrons_load(
    gradclip, megatron_distopt_pp_run, step, what
):
    """PP=2 with the distributed optimizer: each stage's buckets (``dp_group_idx_0``: the
    embeddings and layer 0; ``dp_group_idx_1``: layer 1, the final norm and the output
    layer), against the state each stage's own distributed optimizer holds after its load."""
    pieces, weights = _tensor_parallel_distributed(megatron_distopt_pp_run, step, what)
    assert all(len(p) == 1 for p in pieces.values())  # each tensor on one stage
    folder = megatron_distopt_pp_run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (step, what)
    assert "over 2 model-parallel ranks" in " ".join(doc["description"])
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(pieces)
    for name, row in rows.items():
        assert row["shape"] == list(weights[name][0].shape), name
        assert rel_err(row["norm"], norm(pieces[name])) <= TOL, name
        assert rel_err(row["ratio"], norm(pieces[name]) / norm(weights[name])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(t for p in pieces.values() for t in p)) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):  # a layer on each stage, a group of its own
        members = [
            t for n, p in pieces.items() if n.startswith(f"decoder.layers.{layer}.") for t in p
        ]
        assert members
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members)) <= TOL


@pytest.fixture
def distopt_tp_save(megatron_distopt_tp_run, tmp_path) -> Path:
    return _copied(megatron_distopt_tp_run, tmp_path)


def test_model_parallel_groups_swapped(gradclip, distopt_tp_save):
    """Each tensor-parallel rank's buckets under the other's index: the processes that
    wrote the model's chunks in offset order are then model-parallel ranks 1, 0, not
    Megatron's tensor-parallel order, and the checkpoint is refused."""
    rename = _swapped("dp_group_idx_0.", "dp_group_idx_1.")
    _rewrite_metadata(distopt_tp_save / "iter_0000003", rename)
    result = gradclip("inspect", distopt_tp_save, "--what", "update")
    one_line_exit_3(result, ".metadata", "not one per tensor-parallel rank", "[1, 0]")


def test_a_missing_model_parallel_group(gradclip, distopt_tp_save):
    """Rank 1's buckets gone: rank 0's alone hold half of each split tensor, not the whole
    tensor a single group's buckets would."""
    _rewrite_metadata(
        distopt_tp_save / "iter_0000003", lambda k: None if "dp_group_idx_1." in k else k
    )
    result = gradclip("inspect", distopt_tp_save, "--what", "exp_avg")
    one_line_exit_3(result, ".metadata", "laid out")


def test_a_model_parallel_groups_step_of_another_iteration(gradclip, distopt_tp_save):
    """Rank 1's files of step 2 in step 3's folder: its shards and its buckets agree with
    each other, but its param groups give step 2 against rank 0's 3."""
    new, old = distopt_tp_save / "iter_0000003", distopt_tp_save / "iter_0000002"
    for shard in sorted(new.glob("__1_*.distcp")):
        shutil.copy(old / shard.name, shard)
    result = gradclip("inspect", distopt_tp_save, "--what", "grad_rms")
    one_line_exit_3(result, ".metadata", "no one step")


# ------------------------------------------------------------- bf16 mixed precision


def _bf16_reference(ref: dict, what: str) -> dict[str, torch.Tensor]:
    """The plain mixed-precision optimizer's quantity per parameter, from Megatron's own load:
    ``weights`` its fp32 main params (``fp32_from_fp16_params``, each group's in its
    ``params`` order), the moments torch's AdamW state one level down
    (``optimizer.optimizer``), in float64."""
    torch_state = "optimizer.optimizer."
    if what == "weights":
        out = {}
        for key, value in ref.items():
            if key.startswith("optimizer.fp32_from_fp16_params."):
                group, index = key.split(".")[-2:]
                pid = ref[f"{torch_state}param_groups.{group}.params.{index}"]
                out[ref["param_names"][pid]] = value.double()
        return out
    sub = {k.removeprefix("optimizer."): v for k, v in ref.items() if k.startswith(torch_state)}
    return _measured({**sub, "param_names": ref["param_names"]}, what)


def _model_tensors(ref: dict) -> dict[str, torch.Tensor]:
    """The model's own (bf16) tensors Megatron loaded, by name."""
    return _weights(ref)


def test_the_bf16_fixture_is_megatrons_mixed_precision(megatron_bf16_run):
    folder = megatron_bf16_run / "run" / "iter_0000003"
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the fixture's own: trusted
    entries = meta.state_dict_metadata
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    assert entries[fc1].properties.dtype == torch.bfloat16
    assert entries[f"optimizer.state.fp32_param.{fc1}"].properties.dtype == torch.float32
    assert f"optimizer.state.exp_avg.{fc1}" in entries
    common = torch.load(folder / "common.pt", weights_only=False)  # args: a Namespace
    assert "param_groups" not in common["optimizer"]  # one level down: torch's state dict
    assert float(common["optimizer"]["optimizer"]["state"]["common_step"]) == 3
    ref = _reference(megatron_bf16_run, 3)
    mains, model = _bf16_reference(ref, "weights"), _model_tensors(ref)
    assert set(mains) == set(model)
    for name, main in mains.items():  # the model holds its main param rounded
        assert torch.equal(main.float().to(torch.bfloat16), model[name]), name
    assert any(not torch.equal(m.float(), model[n].float()) for n, m in mains.items())


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
def test_bf16_every_quantity_against_megatrons_load(gradclip, megatron_bf16_run, step, what):
    """bf16 with the plain optimizer: the weights are the fp32 main params, exactly (not the
    model's bf16 tensors), and every ratio divides by them."""
    ref = _reference(megatron_bf16_run, step)
    expected = _bf16_reference(ref, what)
    mains = _bf16_reference(ref, "weights")
    folder = megatron_bf16_run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("megatron", step, what)
    said = " ".join(doc["description"])
    assert "29 bfloat16 model tensors" in said and "fp32 main params of 29" in said, said
    assert set(expected) == set(mains)
    _against_mains(doc, expected, mains, mains, what)  # the mains have the model's shapes


def test_bf16_weights_are_the_fp32_main_params_not_the_model(gradclip, megatron_bf16_run):
    """The bf16 tensors' norm differs from the mains' beyond the tolerance: the report's is
    the mains', and says where it comes from."""
    ref = _reference(megatron_bf16_run, 3)
    mains, model = _bf16_reference(ref, "weights"), _model_tensors(ref)
    assert rel_err(norm(model.values()), norm(mains.values())) > 100 * TOL
    doc = gradclip("inspect", megatron_bf16_run / "run", "--what", "weights", "--format", "json")
    assert doc.code == 0, doc.err
    assert rel_err(doc.json()["total_norm"], norm(mains.values())) <= TOL
    evidence = doc.json()["measured"]["evidence"]
    assert "fp32 main params (optimizer.state.fp32_param entries" in evidence, evidence
    auto = gradclip("inspect", megatron_bf16_run / "run", "--format", "json")
    assert auto.code == 0 and auto.json()["what"] == "exp_avg", auto.err
    grads = gradclip("inspect", megatron_bf16_run / "run", "--what", "grads")
    one_line_exit_3(grads, "saves no gradients", "--what exp_avg")


@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
@pytest.mark.parametrize("fixture", ["megatron_tp_bf16_run", "megatron_pp_bf16_run"])
def test_bf16_tensor_parallel_against_megatrons_load(gradclip, request, fixture, what):
    """TP=2 or PP=2, bf16, the plain optimizer: each rank's fp32 main params are chunks of
    the same ``fp32_param`` tensors, paired with the model's chunks; each rank's reference
    holds its shards of its stage (a replicated tensor on its main replica only)."""
    run = request.getfixturevalue(fixture)
    pieces: dict[str, list[torch.Tensor]] = {}
    mains: dict[str, list[torch.Tensor]] = {}
    for rank in (0, 1):
        ref = torch.load(run / "reference" / f"iter_3.rank{rank}.pt", weights_only=True)
        main = _bf16_reference(ref, "weights")
        for name, value in _bf16_reference(ref, what).items():
            pieces.setdefault(name, []).append(value)
            mains.setdefault(name, []).append(main[name])
    result = gradclip("inspect", run / "run", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(pieces)
    split = [n for n, p in pieces.items() if len(p) == 2]
    if fixture == "megatron_tp_bf16_run":
        assert any("linear_fc1.weight" in n for n in split)
    else:  # each tensor on one stage
        assert not split
    for name, row in rows.items():
        assert row["dtype"] == "float32", name
        assert rel_err(row["norm"], norm(pieces[name])) <= TOL, name
        if what != "weights":
            assert rel_err(row["ratio"], norm(pieces[name]) / norm(mains[name])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(t for p in pieces.values() for t in p)) <= TOL


def test_bf16_two_ranks_print_the_one_process_report(megatron_bf16_run, tmp_path):
    run = megatron_bf16_run / "run"
    jobs = [
        {"args": ["inspect", str(run), "--what", what, "--format", fmt, "--no-progress"]}
        for what, fmt in (("weights", "json"), ("weights", "table"), ("update", "json"))
    ]
    same_under_torchrun(jobs, tmp_path)


@pytest.fixture
def bf16_save(megatron_bf16_run, tmp_path) -> Path:
    return _copied(megatron_bf16_run, tmp_path)


def test_bf16_a_missing_fp32_param(gradclip, bf16_save):
    fc2 = "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc2.bias"
    _rewrite_metadata(bf16_save / "iter_0000003", lambda k: None if k == fc2 else k)
    result = gradclip("inspect", bf16_save, "--what", "weights")
    one_line_exit_3(result, ".metadata", "no optimizer.state.fp32_param", "linear_fc2.bias")


def test_bf16_fp32_params_that_are_not_the_models(gradclip, bf16_save):
    """Two layer norms' fp32 main params swapped (the same shape): each is read, rounded, and
    found not to be its model tensor; the file is named, no number reported."""
    rename = _swapped(
        "fp32_param.decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "fp32_param.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    )
    _rewrite_metadata(bf16_save / "iter_0000003", rename)
    for what in ("weights", "exp_avg"):  # the ratio reads the weights too
        result = gradclip("inspect", bf16_save, "--what", what)
        one_line_exit_3(result, ".distcp", "fp32 main param", "disagree")


def test_bf16_fp32_param_of_another_shape(gradclip, bf16_save):
    rename = _swapped(
        "fp32_param.decoder.layers.mlp.linear_fc1.bias",
        "fp32_param.decoder.layers.mlp.linear_fc2.bias",
    )
    _rewrite_metadata(bf16_save / "iter_0000003", rename)
    result = gradclip("inspect", bf16_save, "--what", "update")
    one_line_exit_3(result, ".metadata", "not its fp32 main param")


def _distributed_mains(ref: dict) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 main param as the distributed optimizer holds it after its own
    load (``megatron_run.py``'s ``distopt.<name>.param``), in float64."""
    return {
        k[len("distopt.") : -len(".param")]: v.double()
        for k, v in ref.items()
        if k.startswith("distopt.") and k.endswith(".param")
    }


def _against_mains(doc: dict, expected: dict, mains: dict, model: dict, what: str) -> None:
    """``doc`` reports ``expected`` (float64, by name) for every fp32 tensor of the model's
    shape, each per-layer group, the total, and ratios over the fp32 main params."""
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert (row["dtype"], row["shape"]) == ("float32", list(model[name].shape)), name
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        if what != "weights":
            assert rel_err(row["ratio"], norm([expected[name]]) / norm([mains[name]])) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):
        members = [t for n, t in expected.items() if n.startswith(f"decoder.layers.{layer}.")]
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members)) <= TOL


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
def test_bf16_distributed_optimizer_against_megatrons_load(
    gradclip, megatron_distopt_bf16_run, step, what
):
    """bf16 with the distributed optimizer on 2 data-parallel ranks: the buckets' ``param``
    (the fp32 main params) are the weights, the moments beside them."""
    ref = _reference(megatron_distopt_bf16_run, step)
    mains = _distributed_mains(ref)
    expected = mains if what == "weights" else _distributed_measured(ref, what)
    model = _model_tensors(ref)
    assert set(mains) == set(model) and all(t.dtype == torch.bfloat16 for t in model.values())
    folder = megatron_distopt_bf16_run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (step, what)
    said = " ".join(doc["description"])
    assert "their param, the fp32 main params of 29, the weights measured" in said, said
    _against_mains(doc, expected, mains, model, what)
    if what == "weights":
        assert "distributed optimizer's fp32 main params" in doc["measured"]["evidence"]


def test_bf16_distributed_optimizer_of_a_sharding_not_read(
    gradclip, megatron_distopt_bf16_run, tmp_path
):
    """The distributed optimizer's state saved in a sharding gradclip does not read (named
    in common.pt): the moments are refused, and the weights are the model's bf16 tensors,
    measured as they are and said to be, not passed off as the fp32 main params."""
    run = shutil.copytree(megatron_distopt_bf16_run / "run" / "iter_0000003", tmp_path / "it")
    state = torch.load(run / "common.pt", weights_only=False)  # the fixture's own: a Namespace
    state["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    torch.save(state, run / "common.pt")
    model = _model_tensors(_reference(megatron_distopt_bf16_run, 3))
    doc = gradclip("inspect", run, "--what", "weights", "--format", "json")
    assert doc.code == 0, doc.err
    assert rel_err(doc.json()["total_norm"], norm(model.values())) <= TOL
    assert "model's bfloat16 tensors (the fp32 main params" in doc.json()["measured"]["evidence"]
    said = " ".join(doc.json()["description"])
    assert "'fully_sharded_model_space'" in said and "weights measured are the model's " \
        "bfloat16 tensors" in said, said
    one_line_exit_3(gradclip("inspect", run, "--what", "exp_avg"), "fully_sharded_model_space")


def test_bf16_tensor_parallel_fully_reshardable_main_params_not_the_models(
    gradclip, megatron_distopt_tp_fully_bf16_run
):
    """TP=2, bf16, the distributed optimizer saved fully_reshardable by Megatron-core 0.16.1
    on this CPU: Megatron's own load gives fp32 main params that do not round to their model
    tensors for the first parameters (the later ones do), on both ranks. gradclip reads the
    main params as the weights only where they are the model's, so it refuses, one line
    naming the file, rather than measure either copy as the weights."""
    run = megatron_distopt_tp_fully_bf16_run
    disagree = set()
    for rank in (0, 1):
        ref = torch.load(run / "reference" / f"iter_3.rank{rank}.pt", weights_only=True)
        for key, name in ref["model_names"].items():
            model, main = ref.get(f"model.{key}"), ref.get(f"distopt.{name}.param")
            if model is not None and main is not None:
                if not torch.equal(main.to(torch.bfloat16), model):
                    disagree.add(name)
    assert "embedding.word_embeddings.weight" in disagree and "output_layer.weight" not in disagree
    for what in ("weights", "exp_avg"):
        result = gradclip("inspect", run / "run", "--what", what)
        one_line_exit_3(result, ".distcp", "fp32 main param (optimizer.state.param)",
                        "is not the model's tensor")


@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
def test_bf16_tensor_parallel_distributed_optimizer_against_megatrons_load(
    gradclip, megatron_distopt_tp_bf16_run, what
):
    """TP=2, bf16, the distributed optimizer: each split parameter's fp32 main param is
    assembled from both ranks' buckets, as its moments are."""
    run = megatron_distopt_tp_bf16_run
    pieces, mains = {}, {}
    for rank in (0, 1):
        ref = torch.load(run / "reference" / f"iter_3.rank{rank}.pt", weights_only=True)
        main = _distributed_mains(ref)
        measured = main if what == "weights" else _distributed_measured(ref, what)
        for key, name in ref["model_names"].items():
            if f"model.{key}" in ref:  # this rank's shard, or the main replica
                pieces.setdefault(name, []).append(measured[name])
                mains.setdefault(name, []).append(main[name])
    result = gradclip("inspect", run / "run", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 3 and "over 2 model-parallel ranks" in " ".join(doc["description"])
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(pieces)
    assert any(len(p) == 2 for p in pieces.values()) and any(len(p) == 1 for p in pieces.values())
    for name, row in rows.items():
        assert row["dtype"] == "float32", name
        assert math.prod(row["shape"]) == sum(t.numel() for t in mains[name]), name
        assert rel_err(row["norm"], norm(pieces[name])) <= TOL, name
        if what != "weights":
            assert rel_err(row["ratio"], norm(pieces[name]) / norm(mains[name])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(t for p in pieces.values() for t in p)) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in (0, 1):
        members = [
            t for n, p in pieces.items() if n.startswith(f"decoder.layers.{layer}.") for t in p
        ]
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members)) <= TOL


def test_the_fully_reshardable_fixture(megatron_distopt_fully_bf16_run):
    folder = megatron_distopt_fully_bf16_run / "run" / "iter_0000003"
    entries = pickle.loads((folder / ".metadata").read_bytes()).state_dict_metadata
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    assert entries[f"optimizer.state.param.{fc1}"].size == entries[fc1].size
    assert not any(k.startswith("optimizer.distributed.") for k in entries)
    common = torch.load(folder / "common.pt", weights_only=False)  # args: a Namespace
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert "state" not in common["optimizer"]["optimizer"]  # the step: in the param groups
    assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {3}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
def test_bf16_fully_reshardable_against_megatrons_load(
    gradclip, megatron_distopt_fully_bf16_run, step, what
):
    """The distributed optimizer saved fully_reshardable: per parameter, in the model's
    shape, its fp32 main param (the weights), its moments, and the step from common.pt's
    param groups, against Megatron's own load of them."""
    ref = _reference(megatron_distopt_fully_bf16_run, step)
    mains = _distributed_mains(ref)
    expected = mains if what == "weights" else _distributed_measured(ref, what)
    model = _model_tensors(ref)
    assert set(mains) == set(model) == set(expected)
    folder = megatron_distopt_fully_bf16_run / "run" / f"iter_{step:07d}"
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (step, what)
    said = " ".join(doc["description"])
    assert "fully_reshardable" in said and "fp32 main params of 29" in said, said
    _against_mains(doc, expected, mains, model, what)


def test_bf16_fully_reshardable_a_missing_param(
    gradclip, megatron_distopt_fully_bf16_run, tmp_path
):
    save = tmp_path / "save"
    shutil.copytree(megatron_distopt_fully_bf16_run / "run", save)
    gone = "optimizer.state.param.output_layer.weight"
    _rewrite_metadata(save / "iter_0000003", lambda k: None if k == gone else k)
    result = gradclip("inspect", save, "--what", "exp_avg")
    one_line_exit_3(result, ".metadata", "no optimizer.state.param of output_layer.weight")


@pytest.fixture
def distopt_bf16_save(megatron_distopt_bf16_run, tmp_path) -> Path:
    return _copied(megatron_distopt_bf16_run, tmp_path)


def test_bf16_a_buckets_param_of_another_length(gradclip, distopt_bf16_save):
    """Bucket 0's param under bucket 1's name and back: each bucket's param is then not the
    length of its moments."""
    rename = _swapped(".bucket_idx_0.param", ".bucket_idx_1.param")
    _rewrite_metadata(distopt_bf16_save / "iter_0000003", rename)
    result = gradclip("inspect", distopt_bf16_save, "--what", "weights")
    one_line_exit_3(result, ".metadata", "param, exp_avg and exp_avg_sq of one length")


def test_bf16_a_buckets_param_of_another_step(gradclip, distopt_bf16_save):
    """Step 2's bucket chunks in step 3's files: their fp32 params do not round to the bf16
    model tensors."""
    new, old = distopt_bf16_save / "iter_0000003", distopt_bf16_save / "iter_0000002"
    for shard in sorted(new.glob("__1_*.distcp")):  # the second rank's: buckets only
        shutil.copy(old / shard.name, shard)
    result = gradclip("inspect", distopt_bf16_save, "--what", "weights")
    one_line_exit_3(result, "__1_", ".distcp", "is not its weight")


# ------------------------------------------------------------- Mixture of Experts

LAYERS, EXPERTS = (0, 1), (0, 1, 2, 3)
MOE_LAYERS = {"ep1": LAYERS, "ep2": LAYERS, "dense1": (1,)}  # dense1: layer 0 a dense MLP


def _moe_reference(run: Path, step: int, what: str) -> dict[str, torch.Tensor]:
    """Each parameter's quantity (``weights`` its weight) by name, from Megatron's own load of
    every rank (``megatron_run.py moe``), in float64: an expert named by its layer and global
    index. Each tensor is taken from the one rank that holds its main replica (an expert
    from its expert-parallel rank, the rest from rank 0), never twice. Under expert
    parallelism the ChainedOptimizer's two optimizers (``optimizer.0.``: the dense
    parameters', ``optimizer.1.``: the experts') each key their state by their own ids."""
    files = sorted((run / "reference").glob(f"iter_{step}.rank*.pt")) or [
        run / "reference" / f"iter_{step}.pt"
    ]
    out: dict[str, torch.Tensor] = {}
    for file in files:
        ref = torch.load(file, weights_only=True)
        if what == "weights":
            found = {
                n: ref[f"model.{k}"] for k, n in ref["model_names"].items() if f"model.{k}" in ref
            }
        elif "param_names" in ref:
            found = _measured(ref, what)
        else:  # chained: each optimizer's state as one optimizer's, with its own ids
            found = {}
            for k in (0, 1):
                own = {
                    f"optimizer.{key[len(f'optimizer.{k}.'):]}": value
                    for key, value in ref.items()
                    if key.startswith(f"optimizer.{k}.")
                }
                own.setdefault("optimizer.state.common_step", ref["optimizer.0.state.common_step"])
                found.update(_measured({**own, "param_names": ref[f"param_names.{k}"]}, what))
        assert not set(found) & set(out), set(found) & set(out)  # every tensor counted once
        out.update(found)
    return out


def _against(
    doc: dict, expected: dict[str, torch.Tensor], weights: dict | None = None, moe=LAYERS
) -> None:
    """``doc`` reports ``expected`` (float64, by name): every tensor, every layer's group (an
    MoE layer's experts and router in it), the total, and each ratio over ``weights``."""
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert row["shape"] == list(expected[name].shape), name
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        if weights is not None:
            assert rel_err(row["ratio"], norm([expected[name]]) / norm([weights[name]])) <= TOL
    groups = {g["name"]: g for g in doc["groups"]}
    for layer in LAYERS:
        members = {n: t for n, t in expected.items() if n.startswith(f"decoder.layers.{layer}.")}
        mlp = f"decoder.layers.{layer}.mlp."
        if layer in moe:  # the router and every expert, each a tensor of its own
            assert {f"{mlp}router.weight"} | {
                f"{mlp}experts.experts.{e}.linear_fc{i}.weight" for e in EXPERTS for i in (1, 2)
            } <= set(members)
        assert rel_err(groups[f"decoder.layers.{layer}"]["norm"], norm(members.values())) <= TOL
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL


def test_the_moe_fixtures_are_megatrons_layout(megatron_moe_runs):
    """Megatron stacks each expert's tensors by layer and global expert index; with expert
    parallelism each rank writes its own experts' chunks and the optimizers are chained."""
    for ranks, name in ((1, "ep1"), (2, "ep2")):
        folder = megatron_moe_runs[name] / "run" / "iter_0000003"
        meta = pickle.loads((folder / ".metadata").read_bytes())  # the fixture's own: trusted
        fc1 = meta.state_dict_metadata["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        assert list(fc1.size) == [len(LAYERS), len(EXPERTS), 32, 16]
        assert list(meta.state_dict_metadata["decoder.layers.mlp.router.weight"].size) == [
            len(LAYERS), len(EXPERTS), 16,
        ]
        writers = {
            (tuple(i.offset)[1], v.relative_path.split("_")[2])
            for i, v in meta.storage_data.items()
            if i.fqn == "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        }
        assert {e for e, _ in writers} == set(EXPERTS)
        assert {w for e, w in writers if e >= 2} == ({"1"} if ranks == 2 else {"0"})
    common = torch.load(
        megatron_moe_runs["ep2"] / "run" / "iter_0000003" / "common.pt", weights_only=False
    )
    assert sorted(common["optimizer"]) == [0, 1]  # ChainedOptimizer: dense, experts


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
@pytest.mark.parametrize("name", ["ep1", "ep2", "dense1"])
def test_moe_every_quantity_against_megatrons_load(gradclip, megatron_moe_runs, name, what, step):
    """Every expert a tensor of its own, named by its layer and global expert index, the
    router a parameter, each in its layer's group; expert-parallel ranks' experts joined;
    a dense layer before an MoE one (Megatron then saves each layer under its number)."""
    run = megatron_moe_runs[name]
    expected = _moe_reference(run, step, what)
    weights = _moe_reference(run, step, "weights")
    assert set(expected) == set(weights)
    assert {f"decoder.layers.{layer}.mlp.experts.experts.{e}.linear_fc2.weight"
            for layer in MOE_LAYERS[name] for e in EXPERTS} <= set(expected)
    assert not any(f"layers.{layer}.mlp.router" in n for n in expected
                   for layer in set(LAYERS) - set(MOE_LAYERS[name]))
    result = gradclip(
        "inspect", run / "run" / f"iter_{step:07d}", "--what", what, "--format", "json"
    )
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("megatron", step, what)
    _against(doc, expected, None if what == "weights" else weights, MOE_LAYERS[name])


@pytest.mark.parametrize("name", ["ep1", "ep2"])
def test_moe_trend_over_the_save_folder(gradclip, megatron_moe_runs, name):
    run = megatron_moe_runs[name]
    result = gradclip("trend", run / "run", "--what", "update", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == list(STEPS)
    for point, step in zip(points, STEPS):
        expected = _moe_reference(run, step, "update")
        assert rel_err(point["total_norm"], norm(expected.values())) <= TOL
        expert = "decoder.layers.1"
        members = [t for n, t in expected.items() if n.startswith(f"{expert}.")]
        assert rel_err(point["groups"][expert], norm(members)) <= TOL


def test_moe_two_ranks_print_the_one_process_report(megatron_moe_runs, tmp_path):
    run = megatron_moe_runs["ep2"] / "run"
    jobs = [
        {"args": ["inspect", str(run), "--what", what, "--format", fmt, "--no-progress"]}
        for what, fmt in (("weights", "table"), ("exp_avg", "json"), ("update", "table"))
    ]
    jobs.append({"args": ["trend", str(run), "--what", "grad_rms", "--format", "json"]})
    same_under_torchrun(jobs, tmp_path)


@pytest.fixture
def moe_save(megatron_moe_runs, tmp_path) -> Path:
    return _copied(megatron_moe_runs["ep2"], tmp_path)


def test_moe_a_truncated_expert_file(gradclip, moe_save):
    """Rank 1's file of experts 2 and 3 cut short."""
    folder = moe_save / "iter_0000003"
    meta = pickle.loads((folder / ".metadata").read_bytes())
    shard = next(
        folder / v.relative_path
        for i, v in meta.storage_data.items()
        if i.fqn == "decoder.layers.mlp.experts.experts.linear_fc1.weight" and i.offset[1] == 3
    )
    shard.write_bytes(shard.read_bytes()[:100])
    one_line_exit_3(gradclip("inspect", moe_save, "--what", "exp_avg"), shard.name)


def test_moe_a_missing_expert_shard(gradclip, moe_save):
    """Expert 3's chunk of layer 1 gone from the metadata: its tensor is not covered."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    folder = moe_save / "iter_0000003"
    meta = pickle.loads((folder / ".metadata").read_bytes())
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    entry = meta.state_dict_metadata[key]
    entry.chunks = [c for c in entry.chunks if tuple(c.offsets)[:2] != (1, 3)]
    assert all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    result = gradclip("inspect", moe_save, "--what", "weights")
    one_line_exit_3(result, ".metadata", "linear_fc2.weight")


def test_moe_a_missing_expert_file(gradclip, moe_save):
    shard = sorted((moe_save / "iter_0000003").glob("__1_*.distcp"))[0]
    shard.unlink()
    one_line_exit_3(gradclip("inspect", moe_save, "--what", "update"), shard.name)


@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
def test_moe_distributed_optimizer_against_megatrons_load(
    gradclip, megatron_moe_distopt_run, what
):
    """2 data-parallel ranks, the distributed optimizer: every expert in the grad buffer's
    buckets, laid out expert by expert as Megatron's DDP lays out ``local_experts``. The
    routers' expert bias (torch's buffers, updated by Megatron's rule, not by Adam) is saved
    among the model's tensors: never a weight, nor in a bucket's layout."""
    ref = _reference(megatron_moe_distopt_run, 3)
    buffers = set(ref["buffer_names"])
    assert buffers == {f"decoder.layers.{layer}.mlp.router.expert_bias" for layer in LAYERS}
    assert all(_weights(ref)[n].abs().max() > 0 for n in buffers)  # updated: they would count
    weights = {n: t for n, t in _weights(ref).items() if n not in buffers}
    expected = weights if what == "weights" else _distributed_measured(ref, what)
    expected = {n: t.double() for n, t in expected.items()}
    run = megatron_moe_distopt_run / "run"
    result = gradclip("inspect", run, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    if what != "weights":
        assert "dp_reshardable buckets" in " ".join(doc["description"])
    assert doc["roles"]["buffer"] == len(buffers)
    _against(doc, expected, None if what == "weights" else weights)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", (*QUANTITIES, "weights"))
@pytest.mark.parametrize(
    "fixture,said",
    [
        (
            "megatron_moe_ep_distopt_run",
            "buckets over 2 expert-parallel ranks (chained_1.optimizer.distributed.*)",
        ),
        ("megatron_moe_ep_fully_run", "2 distributed optimizers' fully_reshardable state"),
    ],
)
def test_moe_expert_parallel_distributed_optimizer_against_megatrons_load(
    gradclip, request, fixture, said, what, step
):
    """2 expert-parallel ranks, the distributed optimizer: the ChainedOptimizer's dense
    optimizer's buckets (``chained_0.``, over both data-parallel ranks) and the experts'
    (``chained_1.``, each rank's own experts in its ``dp_group_idx``), or both saved
    fully_reshardable (per parameter), against the moments each rank's optimizers hold once
    they have loaded them (Megatron's own load, fully_reshardable); each tensor from its
    main replica's rank."""
    run = request.getfixturevalue(fixture)
    moments, weights = _tensor_parallel_distributed(run, step, "exp_avg" if what == "weights"
                                                    else what)
    expected = weights if what == "weights" else moments
    assert all(len(p) == 1 for p in expected.values())  # each tensor from one rank, once
    expected = {n: p[0].double() for n, p in expected.items()}
    weights = {n: p[0] for n, p in weights.items()}
    result = gradclip("inspect", run / "run" / f"iter_{step:07d}", "--what", what,
                      "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (step, what)
    description = " ".join(doc["description"])
    assert "ChainedOptimizer's 2 distributed optimizers" in description, description
    assert said in description, description
    _against(doc, expected, None if what == "weights" else weights)


def test_moe_expert_parallel_distributed_optimizer_under_torchrun(
    megatron_moe_ep_distopt_run, tmp_path
):
    run = megatron_moe_ep_distopt_run / "run"
    jobs = [
        {"args": ["inspect", str(run), "--what", what, "--format", "json", "--no-progress"]}
        for what in ("weights", "grad_rms")
    ]
    same_under_torchrun(jobs, tmp_path)


@pytest.fixture
def moe_distopt_save(megatron_moe_ep_distopt_run, tmp_path) -> Path:
    return _copied(megatron_moe_ep_distopt_run, tmp_path)


def test_moe_the_experts_buckets_missing(gradclip, moe_distopt_save):
    """The experts' optimizer's buckets gone from the metadata: the experts' moments are not
    there, and the dense optimizer's alone are not the whole state."""
    _rewrite_metadata(
        moe_distopt_save / "iter_0000003", lambda k: None if k.startswith("chained_1.") else k
    )
    result = gradclip("inspect", moe_distopt_save, "--what", "exp_avg")
    one_line_exit_3(result, ".metadata", "buckets of 1 chained distributed optimizers")


def test_moe_expert_buckets_of_another_step(gradclip, moe_distopt_save):
    """Rank 1's files of step 2 in step 3's folder: its experts and its buckets agree with
    each other, but its share of the dense optimizer's buckets is not the dense weights."""
    new, old = moe_distopt_save / "iter_0000003", moe_distopt_save / "iter_0000002"
    for shard in sorted(new.glob("__1_*.distcp")):
        shutil.copy(old / shard.name, shard)
    result = gradclip("inspect", moe_distopt_save, "--what", "update")
    one_line_exit_3(result, "__1_", "chained_0.", "is not its weight")


def test_moe_chained_optimizers_of_another_sharding(gradclip, moe_distopt_save):
    common = moe_distopt_save / "iter_0000003" / "common.pt"
    state = torch.load(common, weights_only=False)  # the fixture's own: args is a Namespace
    state["optimizer"][1]["param_state_sharding_type"] = "fully_sharded_model_space"
    torch.save(state, common)
    result = gradclip("inspect", moe_distopt_save, "--what", "grad_rms")
    one_line_exit_3(result, "common.pt", "fully_sharded_model_space", "dp_reshardable")
