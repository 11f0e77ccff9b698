"""A Megatron ``torch_dist`` checkpoint's facts and their wording, apart: the sentences
expected here are the ones real Megatron-core runs print (docs/layouts/_examples/megatron.md,
checked by tests/frameworks/test_megatron.py), made from facts alone."""

from __future__ import annotations

from gradclip_cli.source.layouts.megatron import TITLE
from gradclip_cli.source.layouts.megatron.facts import (
    BUCKETS,
    FULLY,
    NONE,
    PER_PARAMETER,
    UNREAD,
    Buckets,
    DistCkptFacts,
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
        "title": TITLE, "folder": "iter_0000003", "tracked": True, "step": 3, "tensors": 29,
        "layers": 2, "state": PER_PARAMETER, "parameters": 29, **given,
    })


def _one(count: int, ranks: int = 1) -> Buckets:
    return Buckets("the distributed optimizer's", count, ranks, "model-parallel", "")


def test_per_parameter_moments():
    said = wording(_facts())
    assert said.description == (
        f"{_AT}iteration 3: 29 model tensors (2 stacked layers split per layer), "
        "optimizer state for 29 parameters"
    )
    assert said.weight_evidence == _SAID
    assert said.optimizer_evidence == (
        f"{_SAID}, optimizer.state entries, common.pt's step and betas"
    )
    assert said.optimizer_error is None


def test_the_fp32_main_params_of_a_bf16_model():
    said = wording(_facts(mains=29, main_dtypes="bfloat16"))
    assert said.description == (
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
    assert "29 model tensors, 20 of them bfloat16, (2 stacked" in said.description
    assert "from the distributed optimizer's fully_reshardable state (optimizer.state.*) and " \
        "the fp32 main params of 20 (optimizer.state.param)" in said.description
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
    assert said.description == (
        f"{_AT}iteration 3: 29 model tensors (2 stacked layers split per layer), optimizer "
        "state for 29 parameters from the distributed optimizer's 3 dp_reshardable buckets "
        f"(optimizer.distributed.*){_PLACED}"
    )
    assert said.optimizer_evidence == (
        f"{_SAID}, the distributed optimizer's dp_reshardable buckets "
        "(optimizer.distributed.*), their param groups' step and betas"
    )
    over = wording(_facts(state=BUCKETS, buckets=(_one(4, 2),))).description
    assert "4 dp_reshardable buckets over 2 model-parallel ranks (optimizer.distributed.*)" in over


def test_a_chain_of_buckets_names_each_optimizer():
    dense = Buckets("the dense parameters'", 2, 1, "model-parallel", "chained_0.")
    experts = Buckets("the experts'", 4, 2, "expert-parallel", "chained_1.")
    said = wording(_facts(tensors=35, parameters=35, state=BUCKETS, chained=2,
                          buckets=(dense, experts)))
    assert said.description.endswith(
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
    assert said.description.endswith(
        f"the optimizer state is {unread}; the weights measured are the model's bfloat16 "
        "tensors, its fp32 main params being in that state"
    )
    assert said.optimizer_evidence is None
    assert "the model's bfloat16 tensors (the fp32 main params" in said.weight_evidence


def test_the_title_and_the_tracker_are_the_callers():
    said = wording(_facts(title="NeMo 2 checkpoint's weights/", tracked=False, state=NONE,
                          parameters=0, step=None))
    assert said.description == (
        "NeMo 2 checkpoint's weights/ at iteration None: 29 model tensors (2 stacked layers "
        "split per layer), optimizer state for 0 parameters"
    )
    assert said.optimizer_evidence is None
