"""The verl layout's DTensor reader on files torch's own FSDP2 wrote (``verl_fsdp2_ranks.py``).

verl's own checkpoint manager is run in ``tests/frameworks/test_verl.py`` (a venv
of its own); here the same files come from torch alone, so that the reader of
DTensor pickles is checked in every run: against ``full_tensor()`` of each
tensor (float64 norms), and refusing what it does not place (a ``Partial``
placement, a 2-D mesh, torch's wrapper-subclass rebuild on its own).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.dtensor_pickle import GLOBALS, DTensorShard
from gradclip_cli.source.files.weights_pickle import Outside, allowing
from tests.cli.support import rel_err
from tests.frameworks.support import TOL, adam_measured, norm, one_line_exit_3


def _actor(files):
    return files / "global_step_2" / "actor"


def _inspect(gradclip, folder, what):
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    return result.json()


def test_each_ranks_shard_is_placed_where_torch_put_it(verl_fsdp2_files):
    whole = torch.load(verl_fsdp2_files / "reference.pt", weights_only=True)["weights"]
    for rank in (0, 1):
        with allowing(GLOBALS):
            root = load_checkpoint(
                _actor(verl_fsdp2_files) / f"model_world_size_2_rank_{rank}.pt",
                trust_pickle=False, verify=False,
            ).root
        for name, shard in root.items():
            assert isinstance(shard, DTensorShard)
            assert shard.shape == whole[name].shape and shard.coordinate == (rank,)
            offsets, sizes = shard.box()
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            assert torch.equal(shard.local, whole[name][index]), name


def test_weights_against_full_tensors(gradclip, verl_fsdp2_files):
    weights = torch.load(verl_fsdp2_files / "reference.pt", weights_only=True)["weights"]
    doc = _inspect(gradclip, _actor(verl_fsdp2_files), "weights")
    assert (doc["format"], doc["step"]) == ("verl-fsdp", 2)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([weights[name]])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(weights.values())) <= TOL


@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update"])
def test_moments_against_full_tensors(gradclip, verl_fsdp2_files, what):
    ref = torch.load(verl_fsdp2_files / "reference.pt", weights_only=True)
    hyper = {n: g for g in ref["groups"] for n in g["params"]}
    expected = adam_measured(ref["state"], hyper, what)
    doc = _inspect(gradclip, _actor(verl_fsdp2_files), what)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL


@pytest.mark.parametrize("trust", [(), ("--trust-pickle",)], ids=["restricted", "trusted"])
def test_a_partial_placement_is_refused(gradclip, verl_fsdp2_files, trust):
    """By name, whichever reader read it (and whether or not torch.distributed.tensor is
    imported, which widens torch's own weights-only reader to DTensors)."""
    one_line_exit_3(
        gradclip("inspect", verl_fsdp2_files / "partial", *trust),
        "is placed Partial", "Shard or Replicate",
    )


def test_a_two_dimensional_mesh_is_refused(gradclip, verl_fsdp2_files):
    one_line_exit_3(
        gradclip("inspect", verl_fsdp2_files / "mesh2d"), "device mesh of [2, 1] ranks"
    )


class _Reduces:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


def test_the_wrapper_rebuild_on_its_own_is_refused(tmp_path):
    """Only a DTensor's rebuild takes ``_rebuild_wrapper_subclass``: called by a pickle on
    its own, the stand-in refuses (and torch's reader, asked next, refuses too)."""
    stand_in = GLOBALS[("torch._utils", "_rebuild_wrapper_subclass")]
    with pytest.raises(Outside) as outside:
        stand_in(GLOBALS[("torch.distributed.tensor", "DTensor")])
    assert "_rebuild_wrapper_subclass" in outside.value.culprit
    path = tmp_path / "model_world_size_1_rank_0.pt"
    call = torch._utils._rebuild_wrapper_subclass
    torch.save({"w": _Reduces(call, (torch.Tensor, torch.float32, (2,), (1,), 0,
                                     torch.strided, torch.device("cpu"), False))}, path)
    with allowing(GLOBALS), pytest.raises(InputError) as refused:
        load_checkpoint(path, trust_pickle=False, verify=False)
    assert str(refused.value).startswith(str(path)) and "\n" not in str(refused.value)


def test_files_without_fsdp_config_take_the_world_size_from_their_names(
    gradclip, verl_fsdp2_files, tmp_path
):
    copy = tmp_path / "actor"
    shutil.copytree(_actor(verl_fsdp2_files), copy)
    (copy / "fsdp_config.json").unlink()
    doc = _inspect(gradclip, copy, "weights")
    assert doc["format"] == "verl-fsdp" and doc["step"] is None


def test_a_rank_outside_the_world_is_refused(gradclip, verl_fsdp2_files, tmp_path):
    copy = tmp_path / "actor"
    shutil.copytree(_actor(verl_fsdp2_files), copy)
    shutil.copy(copy / "model_world_size_2_rank_1.pt", copy / "model_world_size_2_rank_2.pt")
    one_line_exit_3(
        gradclip("inspect", copy), "model_world_size_2_rank_2.pt", "rank 2 of a world of 2"
    )



def test_a_name_one_rank_alone_holds_is_shown_escaped_once(gradclip, verl_fsdp2_files,
                                                          tmp_path):
    """A tensor's name that rank 1's file holds and rank 0's does not, quoted plainly in
    the error and escaped once with its line."""
    from gradclip_cli.escaping import visible

    hostile = "w\\x\t1"
    copy = tmp_path / "actor"
    shutil.copytree(_actor(verl_fsdp2_files), copy)
    file = copy / "model_world_size_2_rank_1.pt"
    state = torch.load(file, weights_only=False)
    first = next(iter(state))
    torch.save({(hostile if k == first else k): v for k, v in state.items()}, file)
    result = gradclip("inspect", copy)
    one_line_exit_3(result, f"names other tensors than model_world_size_2_rank_0.pt "
                            f"('{visible(hostile)}'): the ranks' files are not of one model")

@pytest.mark.parametrize("trust", [(), ("--trust-pickle",)], ids=["restricted", "trusted"])
@pytest.mark.parametrize("name", ["model_world_size_2_rank_0.pt", "optim_world_size_2_rank_1.pt"])
def test_one_rank_file_alone_names_its_folder(gradclip, verl_fsdp2_files, trust, name):
    """One rank's file given alone was refused as unsafe, and under the --trust-pickle the
    refusal offered, failed with torch's DTensor error, naming no file: the refusal names
    the folder, and the folder, as it says, reads."""
    folder = _actor(verl_fsdp2_files)
    file = folder / name
    result = gradclip("inspect", file, *trust)
    one_line_exit_3(result, str(file), f"give the folder: {folder}")
    assert "--trust-pickle" not in result.err
    assert _inspect(gradclip, folder, "weights")["what"] == "weights"


@pytest.mark.parametrize("trust", [(), ("--trust-pickle",)], ids=["restricted", "trusted"])
@pytest.mark.parametrize(("name", "first"), [("model_world_size_2_rank_0.pt", "0.weight"),
                                             ("optim_world_size_2_rank_1.pt", "state.0.exp_avg")])
def test_a_file_of_dtensors_alone_is_refused_by_what_it_holds(gradclip, verl_fsdp2_files,
                                                               tmp_path, trust, name, first):
    """``torch.save`` of one rank's FSDP2 state dict outside any layout: it was refused
    asking for --trust-pickle, under which torch's DTensor error came out naming no file.
    Either way it is one line naming the file and the first DTensor in it."""
    file = tmp_path / "state.pt"
    shutil.copyfile(_actor(verl_fsdp2_files) / name, file)
    result = gradclip("inspect", file, *trust)
    one_line_exit_3(result, str(file), f"{first} is a DTensor", "one rank's shards")
    assert "--trust-pickle" not in result.err and "RuntimeError" not in result.err
