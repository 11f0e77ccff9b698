"""A Megatron checkpoint's facts and their wording, apart (``torch_dist``, then legacy):
the sentences expected here are the ones real Megatron-core runs print
(docs/layouts/_examples/megatron.md, checked by tests/frameworks/test_megatron.py), made
from facts alone."""

from __future__ import annotations

from pathlib import Path

from gradclip_cli.escaping import visible
from gradclip_cli.source.layouts.megatron import TITLE
from gradclip_cli.source.layouts.megatron.facts import (
    BUCKETS,
    FULLY,
    MISSING,
    NONE,
    PER_PARAMETER,
    UNREAD,
    Buckets,
    DistCkptFacts,
    LegacyFacts,
    Stage,
    legacy_wording,
    wording,
)

_SAID = "a torch_dist checkpoint: metadata.json sharded_backend torch_dist"
_AT = "Megatron torch_dist checkpoint (latest_checkpointed_iteration.txt names iter_0000003) at "
_PLACED = (
    ", each parameter's slice placed by Megatron's bucket layout and checked against the "
    "model's tensors"
)


def _facts(**given) -> DistCkptFacts:
    return DistCkptFacts(**{
        "path": Path("run"), "title": TITLE, "folder": "iter_0000003", "tracked": True,
        "step": 3, "tensors": 29, "layers": 2, "state": PER_PARAMETER, "parameters": 29, **given,
    })


def _one(count: int, ranks: int = 1) -> Buckets:
    return Buckets("the distributed optimizer's", count, ranks, "model-parallel", "")


def test_per_parameter_moments():
    said = wording(_facts())
    assert said.description[0] == (
        f"{_AT}iteration 3: 29 model tensors (2 stacked layers split per layer), "
        "optimizer state for 29 parameters"
    )
    assert said.weight_evidence == _SAID
    assert said.optimizer_evidence == (
        f"{_SAID}, optimizer.state entries, common.pt's step and betas"
    )
    assert said.optimizer_error is None
    assert len(said.description) == 1
    assert said.gradient_error == (
        f"{Path('run')}: a {TITLE} saves no gradients (model, optimizer state, common.pt)"
    )


def test_the_fp32_main_params_of_a_bf16_model():
    said = wording(_facts(mains=29, main_dtypes="bfloat16"))
    assert said.description[0] == (
        f"{_AT}iteration 3: 29 bfloat16 model tensors (2 stacked layers split per layer), "
        "optimizer state for 29 parameters and the fp32 main params of 29 "
        "(optimizer.state.fp32_param), the weights measured"
    )
    assert said.weight_evidence == (
        f"{_SAID}, the mixed-precision optimizer's fp32 main params (optimizer.state.fp32_param "
        "entries: the weights Adam updates; the model's bfloat16 tensors are them rounded, "
        "checked)"
    )


def test_some_main_params_say_how_many_of_the_tensors():
    said = wording(_facts(state=FULLY, mains=20, main_dtypes="bfloat16"))
    assert "29 model tensors, 20 of them bfloat16, (2 stacked" in said.description[0]
    assert "from the distributed optimizer's fully_reshardable state (optimizer.state.*) and " \
        "the fp32 main params of 20 (optimizer.state.param)" in said.description[0]
    assert said.weight_evidence.startswith(
        f"{_SAID}, the distributed optimizer's fp32 main params (optimizer.state.param entries"
    )


def test_a_chain_fully_reshardable():
    said = wording(_facts(state=FULLY, chained=2))
    assert said.optimizer_evidence == (
        f"{_SAID}, a ChainedOptimizer's 2 distributed optimizers' fully_reshardable "
        "optimizer.state entries, common.pt's param groups' step and betas"
    )


def test_dp_reshardable_buckets():
    said = wording(_facts(state=BUCKETS, buckets=(_one(3),)))
    assert said.description[0] == (
        f"{_AT}iteration 3: 29 model tensors (2 stacked layers split per layer), optimizer "
        "state for 29 parameters from the distributed optimizer's 3 dp_reshardable buckets "
        f"(optimizer.distributed.*){_PLACED}"
    )
    assert said.optimizer_evidence == (
        f"{_SAID}, the distributed optimizer's dp_reshardable buckets "
        "(optimizer.distributed.*), their param groups' step and betas"
    )
    over = wording(_facts(state=BUCKETS, buckets=(_one(4, 2),))).description[0]
    assert "4 dp_reshardable buckets over 2 model-parallel ranks (optimizer.distributed.*)" in over


def test_a_chain_of_buckets_names_each_optimizer():
    dense = Buckets("the dense parameters'", 2, 1, "model-parallel", "chained_0.")
    experts = Buckets("the experts'", 4, 2, "expert-parallel", "chained_1.")
    said = wording(_facts(tensors=35, parameters=35, state=BUCKETS, chained=2,
                          buckets=(dense, experts)))
    assert said.description[0].endswith(
        "optimizer state for 35 parameters from a ChainedOptimizer's 2 distributed optimizers: "
        "the dense parameters' 2 dp_reshardable buckets (chained_0.optimizer.distributed.*) and "
        "the experts' 4 dp_reshardable buckets over 2 expert-parallel ranks "
        f"(chained_1.optimizer.distributed.*){_PLACED}"
    )
    assert "(chained_N.optimizer.distributed.*)" in said.optimizer_evidence


def test_an_unread_distributed_state_is_the_reason_moments_are_missing():
    said = wording(_facts(state=UNREAD, parameters=0, unread="'other'", sixteen="bfloat16"))
    unread = (
        "Megatron's distributed optimizer's ('other': flat grad-buffer buckets, "
        "optimizer.distributed.*), which gradclip does not read: moments not measured"
    )
    assert said.optimizer_error == f"its optimizer state is {unread}"
    assert said.description[0].endswith(
        f"the optimizer state is {unread}; the weights measured are the model's bfloat16 "
        "tensors, its fp32 main params being in that state"
    )
    assert said.optimizer_evidence is None
    assert "the model's bfloat16 tensors (the fp32 main params" in said.weight_evidence


def test_the_title_and_the_tracker_are_the_callers():
    said = wording(_facts(title="NeMo 2 checkpoint's weights/", tracked=False, state=NONE,
                          parameters=0, step=None))
    assert said.description[0] == (
        "NeMo 2 checkpoint's weights/ at iteration None: 29 model tensors (2 stacked layers "
        "split per layer), optimizer state for 0 parameters"
    )
    assert said.optimizer_evidence is None


# ----------------------------------------------------------------- legacy (mp_rank_XX/)
# The lines expected are those real Megatron-LM runs print (docs/layouts/_examples/
# megatron_legacy.md, checked by tests/frameworks/test_megatron_legacy.py).

_LEGACY = "Megatron legacy checkpoint (latest_checkpointed_iteration.txt names iter_0000003) at "
_MASTERS = (
    "the weights are the optimizer's fp32 masters (fp32_from_fp16_params); the model holds "
    "them rounded"
)
_LAYERS = (
    "each stage numbers its own from 0, named here by the global layer (the args' num_layers "
    "and pipeline split)"
)
_TIED = (
    "; the last stage's output_layer.weight is its copy of embedding.word_embeddings.weight "
    "(tied): not counted, as Megatron's grad norm skips the shared copy"
)


def _legacy(**given) -> LegacyFacts:
    return LegacyFacts(**{
        "path": Path("run"), "folder": "iter_0000003", "tracked": True, "step": 3,
        "ranks": ("mp_rank_00", "mp_rank_01"), "tensors": 29, "skipped": 9,
        "state": PER_PARAMETER, "masters": True, "split": 14, **given,
    })


def test_legacy_tensor_parallel_ranks_with_fp32_masters():
    said = legacy_wording(_legacy())
    assert said.description == (
        f"{_LEGACY}iteration 3: 2 tensor-parallel rank(s) (mp_rank_00, mp_rank_01), 29 model "
        "tensors (9 _extra_state entries skipped per rank)",
        "14 tensors split across the ranks (measured as their shards together), 15 replicated "
        "(counted once, from mp_rank_00, as Megatron's get_grad_norm_fp32 does)",
        _MASTERS,
    )
    assert said.optimizer_evidence == (
        "a Megatron legacy checkpoint: mp_rank_XX/model_optim_rng.pt's optimizer"
    )
    assert said.weight_evidence == (
        "a Megatron legacy checkpoint: mp_rank_XX/model_optim_rng.pt's optimizer "
        "fp32_from_fp16_params"
    )
    assert said.optimizer_error is None
    assert said.gradient_error == (
        f"{Path('run')}: a Megatron legacy checkpoint saves no gradients (model, optimizer "
        "state, model_optim_rng.pt)"
    )


def test_legacy_pipeline_stages_name_their_layers_and_the_tied_copy():
    stages = (Stage("mp_rank_00_000", 0, (("model", 0, 1),)),
              Stage("mp_rank_00_001", 1, (("model", 1, 2),)))
    said = legacy_wording(_legacy(ranks=("mp_rank_00_000", "mp_rank_00_001"), tensors=40,
                                  skipped=4, split=0, stages=stages, tied=True))
    assert said.description == (
        f"{_LEGACY}iteration 3: 2 pipeline stages of 1 tensor-parallel rank(s) (mp_rank_00_000, "
        "mp_rank_00_001), 40 model tensors (4 _extra_state entries skipped per rank)",
        f"decoder layers 0 in mp_rank_00_000, 1-2 in mp_rank_00_001: {_LAYERS}{_TIED}",
        _MASTERS,
    )
    assert said.optimizer_evidence.endswith("mp_rank_XX_YYY/model_optim_rng.pt's optimizer")


def test_legacy_tensor_parallel_ranks_of_each_stage():
    ranks = ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001")
    stages = (Stage("mp_rank_00_000", 0, (("model", 0, 2),)),
              Stage("mp_rank_00_001", 1, (("model", 2, 2),)))
    said = legacy_wording(_legacy(ranks=ranks, tensors=52, skipped=8, split=25, stages=stages))
    assert said.description[0].endswith(
        "2 pipeline stages of 2 tensor-parallel rank(s) (mp_rank_00_000, mp_rank_01_000, "
        "mp_rank_00_001, mp_rank_01_001), 52 model tensors (8 _extra_state entries skipped "
        "per rank)"
    )
    assert said.description[2] == (
        "25 tensors split across the ranks (measured as their shards together), 27 replicated "
        "(counted once, from each stage's mp_rank_00_YYY, as Megatron's get_grad_norm_fp32 "
        "does)"
    )


def test_legacy_virtual_pipeline_chunks():
    stages = (Stage("mp_rank_00_000", 0, (("model0", 0, 1), ("model1", 2, 1))),
              Stage("mp_rank_00_001", 1, (("model0", 1, 1), ("model1", 3, 1))))
    said = legacy_wording(_legacy(ranks=("mp_rank_00_000", "mp_rank_00_001"), split=0,
                                  stages=stages, tied=True))
    assert said.description[1] == (
        "decoder layers 0 (model0), 2 (model1) in mp_rank_00_000; 1 (model0), 3 (model1) in "
        "mp_rank_00_001: each virtual pipeline chunk numbers its own from 0, named here by the "
        "global layer (the args' num_layers, pipeline split and "
        f"virtual_pipeline_model_parallel_size 2){_TIED}"
    )


def test_legacy_distributed_optimizer():
    said = legacy_wording(_legacy(state=BUCKETS))
    assert said.description[-1] == (
        "the optimizer state and the weights (its fp32 params) are distrib_optim.pt's: the "
        f"distributed optimizer's flat grad buffers{_PLACED}"
    )
    assert said.optimizer_evidence == "a Megatron legacy checkpoint: mp_rank_XX/distrib_optim.pt"
    assert said.weight_evidence == (
        "a Megatron legacy checkpoint: mp_rank_XX/distrib_optim.pt's param"
    )


def test_legacy_missing_moments_say_why():
    gone = legacy_wording(_legacy(state=MISSING, masters=False, lacking="mp_rank_01"))
    assert gone.optimizer_error == (
        "mp_rank_01/: its optimizer is Megatron's distributed optimizer, whose state "
        "save_checkpoint writes to distrib_optim.pt beside model_optim_rng.pt, and there is "
        "none: moments not measured"
    )
    assert gone.description[-1] == gone.optimizer_error
    assert gone.optimizer_evidence is None
    assert gone.weight_evidence == (
        "a Megatron legacy checkpoint: mp_rank_XX/model_optim_rng.pt's model"
    )
    unsaved = legacy_wording(_legacy(state=NONE, masters=False, tracked=False, step=None))
    assert unsaved.optimizer_error == "no optimizer state saved (--no-save-optim)"
    assert unsaved.description[0].startswith("Megatron legacy checkpoint: 2 tensor-parallel")


def test_legacy_one_rank_alone_says_so():
    folder = "iter\x1b3"  # a folder's name is untrusted: shown escaped
    said = legacy_wording(_legacy(ranks=("mp_rank_01",), siblings=2, folder=folder))
    assert said.description[0].endswith(": tensor-parallel rank mp_rank_01, 29 model tensors "
                                        "(9 _extra_state entries skipped per rank)")
    assert said.description[-1] == (
        "covers mp_rank_01 only, one of 2 tensor-parallel ranks: its shards alone; "
        f"{visible(folder)}/ holds the whole model"
    )
    assert "\x1b" not in said.description[-1]
    stage = Stage("mp_rank_01_001", 1, (("model", 2, 2),))
    said = legacy_wording(_legacy(ranks=("mp_rank_01_001",), siblings=4,
                                  stages=(stage,), tensor_rank=1))
    assert ": pipeline stage 1's tensor-parallel rank 1 (mp_rank_01_001), " in said.description[0]
    assert said.description[-1].startswith(
        "covers mp_rank_01_001 only, one of 4 ranks of the pipeline stages: its layers and shards"
    )
    assert legacy_wording(_legacy(ranks=("mp_rank_00",), siblings=1)).description[
        -1] == _MASTERS
