"""Every refusal on the frameworks' own layouts offers only what works
(docs/reference/contract.md, --what).

The checkpoints are the session's fixtures, written by the libraries
themselves (Lightning, DCP and its Hugging Face layout, accelerate with and
without FSDP, DeepSpeed alone and under the Trainer, huggingface_hub's
sharded sets). Each is walked by ``walk_refusals``: inspect and clip with
each ``--what``, every flag a refusal offers followed. The Trainer's
folders, accelerate's ``save_state`` folder and a ``save_pretrained`` folder
are walked in ``test_optimizer_layouts.py``.
"""

from __future__ import annotations

import pytest

from tests.cli.support import walk_refusals


def _shard(folder):
    return sorted(folder.glob("*-of-*"))[1]


# fixture -> the paths a user may give for it: the checkpoint, and its parts where
# each is a checkpoint of its own (an index, one shard, DCP's .metadata, a rank folder).
PATHS = {
    "lightning_ckpt": lambda p: [p],
    "lightning_sharded": lambda p: [p],
    "dcp_checkpoint": lambda p: [p, p / ".metadata"],
    "dcp_hf_checkpoint": lambda p: [p],
    "dcp_hf_grads": lambda p: [p],
    "accelerate_fsdp_run": lambda p: [p / "checkpoint-2", p / "checkpoint-2" / "optimizer_0",
                                      p / "checkpoint-2" / "pytorch_model_fsdp_0"],
    "accelerate_state": lambda p: [p.parent / "state_bin"],
    "accelerate_auto_runs": lambda p: [p / "checkpoint_1"],
    "sharded_pretrained": lambda p: [p / "model.safetensors.index.json", _shard(p)],
    "sharded_bin": lambda p: [p, p / "pytorch_model.bin.index.json", _shard(p)],
    "deepspeed_runs": lambda p: [p / "zero1", p / "zero2", p / "zero3",
                                 p / "zero2" / "global_step2"],
    "deepspeed_trainer_run": lambda p: [p / "checkpoint-3", p / "checkpoint-3" / "global_step3"],
}
# Each lacks something a command asks for (gradients, optimizer state...), but these two:
# gradients, weights and Adam state, all of them (the walk checks --what auto there).
REFUSES_NOTHING = {"dcp_checkpoint", "lightning_ckpt"}


@pytest.mark.parametrize("fixture", list(PATHS))
def test_every_refusal_offers_only_what_works(gradclip, request, tmp_path, fixture):
    paths = PATHS[fixture](request.getfixturevalue(fixture))
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    if fixture not in REFUSES_NOTHING:
        assert refusals >= len(paths) and followed >= 1


@pytest.mark.parametrize(("fixture", "sub", "said"), [
    ("trainer_run", "", "a Trainer checkpoint"),
    ("accelerate_state", "", "an accelerate save_state folder"),
    ("deepspeed_runs", "zero2", "a DeepSpeed checkpoint"),
    ("deepspeed_trainer_run", "checkpoint-3", "a DeepSpeed checkpoint"),
])
@pytest.mark.parametrize("key", ["model", "grads"])
def test_a_key_where_the_layout_names_everything_is_refused(gradclip, request, fixture, sub,
                                                            said, key):
    """These layouts save no gradients and name their weights and optimizer state
    themselves: a --key is refused (as torchtitan's is), never ignored while the default
    measures something else."""
    path = request.getfixturevalue(fixture)
    path = path / sub if sub else path
    result = gradclip("inspect", path, "--key", key)
    assert result.code == 3 and result.out == ""
    assert result.err_lines == [
        f"gradclip: {path}: --key {key!r}: {said} saves no gradients and gradclip names its "
        "weights and optimizer state itself: drop --key (--what chooses what is measured)"]


def test_a_dcp_folder_without_gradients_offers_its_other_entries(gradclip, tmp_path):
    """A DCP folder's refusal lists as --key candidates the entries that may hold
    gradients, never the model, the optimizer or a scalar; following one works."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).square().sum().backward()
    adam.step()
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP saves as one process
        dcp.save({"model": model.state_dict(), "optimizer": adam.state_dict(),
                  "accumulated": accumulated, "step": 1},
                 checkpoint_id=str(tmp_path / "ckpt"))
    refused = gradclip("inspect", tmp_path / "ckpt", "--what", "grads")
    assert refused.code == 3
    assert "; candidates for --key: accumulated; " in refused.err_lines[0]
    refusals, followed = walk_refusals(gradclip, [tmp_path / "ckpt"], tmp_path)
    assert refusals >= 3 and followed >= 3
