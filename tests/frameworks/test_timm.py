"""timm ``checkpoint-N.pth.tar``: real saves of timm's ``CheckpointSaver`` (``timm_run.py``).

Every number is checked against float64 computed here from the raw file
(``torch.load``), never through gradclip; the optimizer's ids are the model's
parameters in order (timm's optimizers are built from ``model.parameters()``),
BatchNorm's running statistics and counter set apart.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.cli.support import assert_quantities_refused, rel_err

from .support import TOL, norm, skip_without_frameworks

skip_without_frameworks()

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _params(saved: dict) -> dict[str, torch.Tensor]:
    return {n: t for n, t in saved["state_dict"].items() if n.rsplit(".", 1)[-1] not in _BUFFERS}


def test_the_fixture_is_timms_layout(timm_runs):
    saved = torch.load(timm_runs / "adamw" / "checkpoint-1.pth.tar", weights_only=True)
    assert {"epoch", "arch", "optimizer", "state_dict", "version"} <= set(saved)
    assert saved["epoch"] == 1 and "1.running_mean" in saved["state_dict"]
    assert len(saved["optimizer"]["state"]) == len(_params(saved)) == 6


@pytest.mark.parametrize("epoch", [0, 1])
def test_adamw_moments_map_past_batchnorm(gradclip, timm_runs, epoch):
    path = timm_runs / "adamw" / f"checkpoint-{epoch}.pth.tar"
    saved = torch.load(path, weights_only=True)
    params = _params(saved)
    group = saved["optimizer"]["param_groups"][0]
    expected = {}
    for pid, name in enumerate(params):
        s = saved["optimizer"]["state"][pid]
        expected[name] = s["exp_avg"].double() / (1 - group["betas"][0] ** float(s["step"]))
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg"
    assert doc["step"] is None  # timm counts epochs (``epoch``), not steps
    assert [t["name"] for t in doc["tensors"]] == list(params)
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    for row in doc["tensors"]:
        ratio = norm([expected[row["name"]]]) / norm([params[row["name"]]])
        assert rel_err(row["norm"], norm([expected[row["name"]]])) <= TOL, row["name"]
        assert rel_err(row["ratio"], ratio) <= TOL, row["name"]


def test_weights_are_the_parameters_without_buffers(gradclip, timm_runs):
    path = timm_runs / "adamw" / "checkpoint-1.pth.tar"
    params = _params(torch.load(path, weights_only=True))
    doc = gradclip("inspect", path, "--what", "weights", "--format", "json").json()
    assert [t["name"] for t in doc["tensors"]] == list(params)
    assert rel_err(doc["total_norm"], norm(params.values())) <= TOL


def test_sgd_nesterov_gives_weights_only(gradclip, timm_runs):
    path = timm_runs / "sgd" / "checkpoint-1.pth.tar"
    params = _params(torch.load(path, weights_only=True))
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "weights"
    assert rel_err(doc["total_norm"], norm(params.values())) <= TOL
    result = gradclip("inspect", path, "--what", "update")
    assert result.code == 3
    assert "SGD: with Nesterov momentum its last step needs the last gradient" in result.err
    assert result.err_lines[0].endswith("available: --what weights")


def test_lars_update_is_the_change_it_made(gradclip, timm_runs):
    """timm's LARS scales each gradient by its trust ratio before SGD's momentum, so its
    step is ``lr * momentum_buffer``: exactly the change between the two epochs' weights
    (its weight decay is folded into the buffer)."""
    first, last = (torch.load(timm_runs / "lars" / f"checkpoint-{e}.pth.tar", weights_only=True)
                   for e in (0, 1))
    group = last["optimizer"]["param_groups"][0]
    assert {"trust_clip", "always_adapt", "nesterov", "dampening"} <= set(group)
    before, after = _params(first), _params(last)
    changes = {n: before[n].double() - after[n].double() for n in after}
    buffers = {n: group["lr"] * last["optimizer"]["state"][i]["momentum_buffer"].double()
               for i, n in enumerate(after)}
    doc = gradclip("inspect", timm_runs / "lars" / "checkpoint-1.pth.tar", "--what", "update",
                   "--format", "json").json()
    assert doc["measured"]["explain"].startswith("LARS last update")
    assert rel_err(doc["total_norm"], norm(buffers.values())) <= TOL
    # float32 weights: their difference is exact to about 2**-24 of the weights.
    assert rel_err(doc["total_norm"], norm(changes.values())) <= 1e-4
    for row in doc["tensors"]:
        assert rel_err(row["norm"], norm([buffers[row["name"]]])) <= TOL, row["name"]


def test_lamb_refuses_what_its_trust_ratio_hides(gradclip, timm_runs):
    """timm's LAMB keeps Adam's moments (a step count per group, not per parameter) and
    scales Adam's step by a trust ratio of the weights before the step: no quantity of
    Adam's applies, and nothing is measured as if it were Adam."""
    path = timm_runs / "lamb" / "checkpoint-1.pth.tar"
    params = _params(torch.load(path, weights_only=True))
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "weights"
    assert rel_err(doc["total_norm"], norm(params.values())) <= TOL
    assert_quantities_refused(gradclip, path, "LAMB", {
        "update": "its step is Adam's scaled by a trust ratio of the weights",
        "exp_avg": "its moments' averaging and step count are its own"})


def test_train_py_args_read_as_inert_data(gradclip, timm_runs):
    """timm's ``train.py`` saves its ``args`` (an ``argparse.Namespace``): read as its
    attributes, never constructed, so no --trust-pickle is needed and the numbers are
    the full loader's."""
    path = timm_runs / "adamw_args" / "checkpoint-1.pth.tar"
    saved = torch.load(path, weights_only=False)  # written by the fixture: trusted here
    assert isinstance(saved["args"], argparse.Namespace)
    params = _params(saved)
    group = saved["optimizer"]["param_groups"][0]
    expected = [
        s["exp_avg"].double() / (1 - group["betas"][0] ** float(s["step"]))
        for s in saved["optimizer"]["state"].values()
    ]
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg" and len(doc["tensors"]) == len(params)
    assert rel_err(doc["total_norm"], norm(expected)) <= TOL
    trusted = gradclip("inspect", path, "--trust-pickle", "--format", "json").json()
    assert trusted["total_norm"] == doc["total_norm"]


def test_every_refusal_offers_only_what_works(gradclip, timm_runs, tmp_path):
    from tests.cli.support import walk_refusals

    paths = [timm_runs / run / "checkpoint-1.pth.tar" for run in ("sgd", "adamw", "lamb", "lars")]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 2 * len(paths) and followed > len(paths)


def test_trend_counts_last_and_best_once(gradclip, timm_runs):
    """The saver hard-links ``last.pth.tar`` and ``model_best.pth.tar`` to a numbered
    checkpoint: trend has one point per epoch, in epoch order."""
    folder = timm_runs / "adamw"
    assert (folder / "last.pth.tar").exists()
    doc = gradclip("trend", folder, "--format", "json").json()
    assert [p["source"] for p in doc["points"]] == [
        str(folder / f"checkpoint-{n}.pth.tar") for n in (0, 1)]
