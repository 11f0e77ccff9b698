"""A DeepSpeed checkpoint's facts and their wording, apart: the sentences expected here are
the ones real DeepSpeed runs print (docs/layouts/_examples/deepspeed.md and
deepspeed_universal.md, whose runs tests/layouts/test_deepspeed*.py check), made from facts
alone; no file is read and DeepSpeed is not needed."""

from __future__ import annotations

from dataclasses import replace

from gradclip_cli.source.layouts.deepspeed.facts import (
    PIPELINE,
    PLAIN,
    UNIVERSAL,
    ZERO,
    DeepSpeedFacts,
    wording,
)

_AT = "at global step 2: global_step2/ (named by latest)"
_RANKS = "2 data-parallel rank(s), DeepSpeed 0.19.8"
_ZERO_FROZEN = "2 frozen parameter(s): weights without Adam moments (measured by --what weights)"
_OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _facts(layout: str = ZERO, **given) -> DeepSpeedFacts:
    return DeepSpeedFacts(**{
        "layout": layout, "folder": "global_step2", "step": 2, "version": "0.19.8",
        "parameters": 4, "tensors": 6, "dp": 2, "named_by": "latest", **given,
    })


def test_zero3_with_frozen_parameters():
    said = wording(_facts(stage=3, frozen=2, model_files=(
        "zero_pp_rank_0_mp_rank_00_model_states.pt",), optimizer_files=(_OPTIM,)))
    assert said.description == (
        f"DeepSpeed ZeRO stage 3 checkpoint {_AT}",
        f"{_RANKS}: fp32 master weights and Adam moments of 4 parameters",
        _ZERO_FROZEN,
    )
    assert said.weight_evidence == (
        "a DeepSpeed checkpoint: zero_pp_rank_0_mp_rank_00_model_states.pt, fp32 master weights "
        "in zero_pp_rank_*_mp_rank_00_optim_states.pt (2 ranks)"
    )
    assert said.optimizer_evidence == (
        "a DeepSpeed checkpoint: zero_pp_rank_*_mp_rank_00_optim_states.pt (2 ranks)"
    )
    assert said.gradient_error == "a DeepSpeed checkpoint holds no gradients"


def test_one_data_parallel_rank_names_its_file():
    said = wording(_facts(stage=1, dp=1, model_files=("mp_rank_00_model_states.pt",),
                          optimizer_files=(_OPTIM,)))
    assert said.optimizer_evidence == f"a DeepSpeed checkpoint: {_OPTIM}"
    assert said.description[1].startswith("1 data-parallel rank(s), DeepSpeed 0.19.8:")


def test_zero_over_tensor_parallel_ranks():
    files = tuple(f"zero_pp_rank_0_mp_rank_0{r}_optim_states.pt" for r in (0, 1))
    said = wording(_facts(stage=1, step=3, folder="global_step3", dp=1, parameters=29,
                          tensors=29, tp=2, split=14, optimizer_files=files, model_files=(
                              "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt")))
    assert said.description == (
        "DeepSpeed ZeRO stage 1 checkpoint at global step 3: global_step3/ (named by latest)",
        "2 model-parallel ranks (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s), DeepSpeed "
        "0.19.8: fp32 master weights and Adam moments of 29 parameters",
        "14 tensors split across the model-parallel ranks (measured as their shards together), "
        "15 replicated (counted once, from mp_rank_00, as Megatron's get_grad_norm_fp32 does), "
        "by Megatron's layer names",
    )
    assert said.optimizer_evidence == (
        "a DeepSpeed checkpoint of 2 model-parallel ranks: "
        "zero_pp_rank_0_mp_rank_00_optim_states.pt, zero_pp_rank_0_mp_rank_01_optim_states.pt"
    )


def test_zero1_pipeline_stages_say_their_layer_files_are_not_read():
    said = wording(_facts(stage=1, dp=1, stages=2, layers_unread=True, model_files=(
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"), optimizer_files=(
        _OPTIM, "zero_pp_rank_0_mp_rank_01_optim_states.pt")))
    assert said.description[1].startswith(
        "2 pipeline stages (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s)")
    assert said.description[2] == (
        "a PipelineModule checkpoint: its layer_XX-model_states.pt files are not read, so "
        "parameters without optimizer state (frozen), if any, are left out"
    )
    assert said.weight_evidence.startswith("a DeepSpeed checkpoint of 2 pipeline stages: ")


def test_without_zero_in_bf16():
    said = wording(_facts(PLAIN, tensors=6, frozen=2, masters=4, sixteen="bfloat16",
                          zero_gradient_step=True, model_files=("mp_rank_00_model_states.pt",)))
    assert said.description == (
        f"DeepSpeed checkpoint without ZeRO (stage 0) {_AT}",
        f"{_RANKS}: bfloat16 module, fp32 master weights and Adam moments of 4 parameters",
        "2 parameter(s) without optimizer state (frozen): weights only (measured by --what "
        "weights)",
        "Adam's step is 3: DeepSpeed's fp16/bf16 optimizer took one step with zero gradients to "
        "create its state, and bias-corrects with that count",
    )
    held = "mp_rank_00_model_states.pt's 'optimizer'"
    assert said.optimizer_evidence == f"a DeepSpeed checkpoint without ZeRO: {held}"
    assert said.weight_evidence == (
        "a DeepSpeed checkpoint without ZeRO: mp_rank_00_model_states.pt's module, fp32 master "
        f"weights of 4 in {held} (fp32_groups)"
    )


def test_without_zero_and_without_optimizer_state():
    said = wording(_facts(PLAIN, parameters=None, dp=None, named_by="",
                          model_files=("mp_rank_00_model_states.pt",)))
    assert said.description == (
        "DeepSpeed checkpoint without ZeRO (stage 0) at global step 2: global_step2/",
        "one file, DeepSpeed 0.19.8: the module's weights; no optimizer state was saved",
    )
    assert said.optimizer_evidence is None


def test_without_zero_over_tensor_parallel_ranks():
    models = ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt")
    said = wording(_facts(PLAIN, tp=2, split=3, tensors=5, parameters=5, dp=1,
                          model_files=models))
    assert said.description[1] == (
        "2 model-parallel ranks (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s), DeepSpeed "
        "0.19.8: Adam moments of 5 parameters"
    )
    assert said.weight_evidence == (
        "a DeepSpeed checkpoint without ZeRO of 2 model-parallel ranks: "
        "mp_rank_00_model_states.pt, mp_rank_01_model_states.pt' module"
    )
    assert said.optimizer_evidence == (
        "a DeepSpeed checkpoint without ZeRO of 2 model-parallel ranks: each file's 'optimizer'"
    )
    mixed = wording(_facts(PLAIN, tp=2, sixteen="bfloat16", model_files=models))
    assert mixed.weight_evidence.endswith(
        "ranks: fp32 master weights in each file's 'optimizer' (fp32_groups)")


def test_pipeline_stages_without_zero():
    said = wording(_facts(PIPELINE, tensors=4, dp=1, stages=2, model_files=(
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"), layer_files=tuple(
        f"layer_0{i}-model_states.pt" for i in range(3))))
    assert said.description == (
        f"DeepSpeed pipeline checkpoint without ZeRO (stage 0) {_AT}",
        "2 pipeline stage(s) (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s), DeepSpeed "
        "0.19.8: weights of 4 parameters in 3 layer files (layer_00-model_states.pt .. "
        "layer_02-model_states.pt), Adam moments of 4",
    )
    assert said.optimizer_evidence == (
        "a DeepSpeed pipeline checkpoint without ZeRO of 2 pipeline stages: "
        "mp_rank_00_model_states.pt's 'optimizer', mp_rank_01_model_states.pt's 'optimizer'"
    )


def test_pipeline_stages_over_tensor_parallel_ranks():
    layers = tuple(f"layer_0{i}-model_0{t}-model_states.pt" for i in range(4) for t in (0, 1))
    said = wording(_facts(PIPELINE, parameters=29, tensors=29, dp=1, stages=2, tp=2, split=14,
                          layer_files=layers, model_files=tuple(
                              f"mp_rank_0{r}_model_states.pt" for r in range(4))))
    assert said.description[1:] == (
        "2 pipeline stages x 2 tensor-parallel ranks (mp_rank_00 .. mp_rank_03) x 1 "
        "data-parallel rank(s), DeepSpeed 0.19.8: weights of 29 parameters in 8 layer files "
        "(layer_00-model_00-model_states.pt .. layer_03-model_01-model_states.pt), Adam moments "
        "of 29",
        "14 tensors split across the tensor-parallel ranks (measured as their shards together), "
        "15 replicated (counted once, from each stage's tensor-parallel rank 0, as Megatron's "
        "get_grad_norm_fp32 does), by Megatron's layer names",
    )
    assert said.optimizer_evidence == (
        "a DeepSpeed pipeline checkpoint without ZeRO of 2 pipeline stages x 2 tensor-parallel "
        "ranks: mp_rank_00_model_states.pt's 'optimizer' .. mp_rank_03_model_states.pt's "
        "'optimizer'"
    )


def test_a_trainer_around_the_folder_gives_the_step():
    facts = _facts(stage=2, step=3, folder="global_step3", parameters=27, frozen=1,
                   trainer_step=3, model_files=("mp_rank_00_model_states.pt",),
                   optimizer_files=(_OPTIM,))
    said = wording(facts)
    assert said.description == (
        "Hugging Face Trainer checkpoint at global_step 3 (trainer_state.json), with DeepSpeed",
        "DeepSpeed ZeRO stage 2 checkpoint at global step 3: global_step3/ (named by latest)",
        f"{_RANKS}: fp32 master weights and Adam moments of 27 parameters",
        "1 frozen parameter(s): weights without Adam moments (measured by --what weights)",
    )
    other = wording(replace(facts, step=5))
    assert other.description[-1] == (
        "DeepSpeed counts 5 steps (global_steps), the Trainer 3: the Trainer's global_step is "
        "the step reported"
    )


def test_a_universal_checkpoint():
    said = wording(_facts(UNIVERSAL, folder="global_step2_universal", frozen=2,
                          named_by="latest_universal", model_files=("mp_rank_00_model_states.pt",)))
    assert said.description == (
        "DeepSpeed universal checkpoint at global step 2: global_step2_universal/ (named by "
        "latest_universal), DeepSpeed 0.19.8; 4 trained parameters with Adam's moments, 2 frozen",
    )
    assert said.optimizer_evidence == (
        "a DeepSpeed universal checkpoint: zero/<name>/exp_avg.pt and exp_avg_sq.pt; the "
        "groups' hyperparameters from zero/optimizer_state.pt, their parameters from "
        "mp_rank_00_model_states.pt's param_shapes"
    )
    assert said.weight_evidence == (
        "a DeepSpeed universal checkpoint: zero/<name>/fp32.pt, the fp32 master weights")
    assert said.gradient_error == "a DeepSpeed universal checkpoint holds no gradients"
    unsaved = wording(_facts(UNIVERSAL, frozen=5, unsaved=tuple("abcde"),
                             model_files=("mp_rank_00_model_states.pt",)))
    assert unsaved.description[1] == (
        "5 frozen parameters (a, b, c and 2 more) have no fp32.pt (the converter writes none "
        "for ZeRO 3's frozen parameters): the weights leave them out"
    )


def test_names_from_files_are_escaped():
    said = wording(_facts(folder="step\x1b[31m", version="0.1\n9", step=None, named_by="",
                          stage=2, model_files=("m.pt",), optimizer_files=(_OPTIM,)))
    assert "\x1b" not in said.description[0] and "\n" not in said.description[1]
    assert said.description[0].startswith("DeepSpeed ZeRO stage 2 checkpoint: step")
