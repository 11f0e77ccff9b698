"""What a DeepSpeed checkpoint was found to hold, as data, and the one function that words it.

Each reader (``zero``, ``plain``, ``pipeline``, ``universal``) records facts
(``DeepSpeedFacts``: the ZeRO stage, the ranks and stages, the files, how many parameters
are trained or frozen); ``wording`` makes the report's sentences from them: the
description and the evidence of the weights and of the optimizer state. So what was found
and how it is said are tested apart (``tests/layouts/test_deepspeed_facts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gradclip_cli.escaping import visible
from gradclip_cli.source.interface import Contents

from ..draft import Draft, Wording
from ..hf_trainer import STATE
from .reader import mp_name, span

# Which reader found the facts (``DeepSpeedFacts.layout``).
ZERO = "zero"  # ZeRO 1, 2 or 3: the optimizer's flat partitions
PLAIN = "plain"  # without ZeRO: each model-parallel rank's one model state file
PIPELINE = "pipeline"  # without ZeRO, a PipelineModule's layer files beside its stages
UNIVERSAL = "universal"  # ds_to_universal's zero/<name>/ files


@dataclass(frozen=True)
class DeepSpeedFacts:
    """A DeepSpeed checkpoint's holdings (counts, stages, file names), nothing worded."""

    layout: str  # ZERO, PLAIN, PIPELINE or UNIVERSAL
    folder: str  # the checkpoint folder's name
    step: int | None  # DeepSpeed's global_steps
    version: str | None  # ds_version
    parameters: int | None  # trained parameters (with Adam's moments); None: no optimizer saved
    tensors: int = 0  # parameters measured as weights, trained and frozen
    frozen: int = 0  # parameters without optimizer state
    stage: int = 0  # ZeRO's stage
    dp: int | None = None  # data-parallel ranks, where recorded
    stages: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel ranks
    split: int = 0  # tensors split across the tensor-parallel ranks
    model_files: tuple[str, ...] = ()  # each model-parallel rank's model state file
    optimizer_files: tuple[str, ...] = ()  # ZERO: each rank's data-parallel rank 0 partition
    layer_files: tuple[str, ...] = ()  # PIPELINE: every layer file, sorted
    masters: int = 0  # PLAIN, one rank: fp32 master weights measured (fp32_groups)
    sixteen: str = ""  # PLAIN: the module's 16-bit dtypes where fp32 masters are kept
    zero_gradient_step: bool = False  # Adam's step one past global_steps (fp16/bf16 optimizer)
    layers_unread: bool = False  # ZERO 1 pipeline stages: frozen parameters not read
    unsaved: tuple[str, ...] = ()  # UNIVERSAL: frozen parameters without an fp32.pt
    named_by: str = ""  # the tag file that named the folder: latest, latest_universal
    trainer_step: int | None = None  # a Hugging Face Trainer's global_step around the folder


def wording(facts: DeepSpeedFacts) -> Wording:
    """The report's sentences of a DeepSpeed checkpoint, from its facts."""
    f = facts
    ranks = len(f.model_files)
    at = f" at global step {f.step}" if f.step is not None else ""
    by = f" (named by {f.named_by})" if f.named_by else ""
    made = f", DeepSpeed {visible(f.version)}" if f.version is not None else ""
    if f.layout == UNIVERSAL:
        return _universal(f, f"{at}: {visible(f.folder)}/{by}{made}")
    title = {
        ZERO: f"DeepSpeed ZeRO stage {f.stage} checkpoint",
        PLAIN: "DeepSpeed checkpoint without ZeRO (stage 0)",
        PIPELINE: "DeepSpeed pipeline checkpoint without ZeRO (stage 0)",
    }[f.layout]
    lines = [f"{title}{at}: {visible(f.folder)}/{by}"]
    listed = f"{_ranks_of(f.stages, f.tp)} ({span([mp_name(r) for r in range(ranks)])})"
    of = f" of {_ranks_of(f.stages, f.tp)}" if ranks > 1 else ""
    mp = f"{listed} x " if ranks > 1 else ""
    dp = f"{f.dp} data-parallel rank(s)" if f.dp is not None else "one file"
    if f.layout == ZERO:
        said = f"a DeepSpeed checkpoint{of}: "
        held = span([n if f.dp == 1 else f"{n.replace('rank_0_', 'rank_*_', 1)} ({f.dp} ranks)"
                     for n in f.optimizer_files])
        weight = f"{said}{span(list(f.model_files))}, fp32 master weights in {held}"
        optimizer: str | None = said + held
        lines.append(f"{mp}{dp}{made}: fp32 master weights and Adam moments of "
                     f"{f.parameters} parameters")
        if f.layers_unread:
            lines.append("a PipelineModule checkpoint: its layer_XX-model_states.pt files are "
                         "not read, so parameters without optimizer state (frozen), if any, are "
                         "left out")
    elif f.layout == PIPELINE:
        said = f"a DeepSpeed pipeline checkpoint without ZeRO{of}: "
        files = span(list(f.layer_files))
        weight = f"{said}the layer files ({files})"
        optimizer = said + span([f"{n}'s 'optimizer'" for n in f.model_files])
        if f.tp == 1:
            listed = f"{ranks} pipeline stage(s) ({span([mp_name(r) for r in range(ranks)])})"
        over = f" x {dp}" if f.dp is not None else ""
        lines.append(f"{listed}{over}{made}: weights of {f.tensors} parameters in "
                     f"{len(f.layer_files)} layer files ({files}), Adam moments of {f.parameters}")
    else:
        said = f"a DeepSpeed checkpoint without ZeRO{of}: "
        held = f"{f.model_files[0]}'s 'optimizer'"
        if ranks > 1:
            weight = said + ("fp32 master weights in each file's 'optimizer' (fp32_groups)"
                             if f.sixteen else f"{span(list(f.model_files))}' module")
            held = "each file's 'optimizer'"
        else:
            masters = f", fp32 master weights of {f.masters} in {held} (fp32_groups)"
            weight = f"{said}{f.model_files[0]}'s module{masters if f.masters else ''}"
        optimizer = said + held if f.parameters is not None else None
        precision = f"{f.sixteen} module, fp32 master weights and " if f.sixteen else ""
        lines.append(f"{mp}{dp}{made}: " + (
            f"{precision}Adam moments of {f.parameters} parameters" if f.parameters is not None
            else "the module's weights; no optimizer state was saved"))
    if f.tp > 1:
        ranked, once = (("tensor-parallel ranks", "each stage's tensor-parallel rank 0")
                        if f.stages > 1 else ("model-parallel ranks", mp_name(0)))
        lines.append(
            f"{f.split} tensors split across the {ranked} (measured as their shards together), "
            f"{f.tensors - f.split} replicated (counted once, from {once}, as Megatron's "
            "get_grad_norm_fp32 does), by Megatron's layer names")
    if f.frozen > 0 and f.parameters is not None:
        lines.append(
            f"{f.frozen} frozen parameter(s): weights without Adam moments (measured by --what "
            "weights)" if f.layout == ZERO else f"{f.frozen} parameter(s) without optimizer "
            "state (frozen): weights only (measured by --what weights)")
    if f.zero_gradient_step:
        lines.append(f"Adam's step is {f.step + 1}: DeepSpeed's fp16/bf16 optimizer took one "
                     "step with zero gradients to create its state, and bias-corrects with that "
                     "count")
    if f.trainer_step is not None:
        lines.insert(0, f"Hugging Face Trainer checkpoint at global_step {f.trainer_step} "
                        f"({STATE}), with DeepSpeed")
        if f.step is not None and f.step != f.trainer_step:
            lines.append(f"DeepSpeed counts {f.step} steps (global_steps), the Trainer "
                         f"{f.trainer_step}: the Trainer's global_step is the step reported")
    return Wording(tuple(lines), weight, optimizer,
                   gradient_error="a DeepSpeed checkpoint holds no gradients")


def _ranks_of(stages: int, tp: int) -> str:
    """The model-parallel ranks, in words: ``2 pipeline stages x 2 tensor-parallel ranks``."""
    if stages == 1:
        return f"{tp} model-parallel ranks"
    return f"{stages} pipeline stages" + (f" x {tp} tensor-parallel ranks" if tp > 1 else "")


def _universal(f: DeepSpeedFacts, where: str) -> Wording:
    said = "a DeepSpeed universal checkpoint: zero/<name>/"
    lines = [f"DeepSpeed universal checkpoint{where}; {f.parameters} trained parameters with "
             f"Adam's moments, {f.frozen} frozen"]
    if f.unsaved:
        shown = ", ".join(visible(n) for n in f.unsaved[:3])
        more = f" and {len(f.unsaved) - 3} more" if len(f.unsaved) > 3 else ""
        lines.append(f"{len(f.unsaved)} frozen parameters ({shown}{more}) have no fp32.pt (the "
                     "converter writes none for ZeRO 3's frozen parameters): the weights leave "
                     "them out")
    optimizer = (f"{said}exp_avg.pt and exp_avg_sq.pt; the groups' hyperparameters from "
                 f"zero/optimizer_state.pt, their parameters from {f.model_files[0]}'s "
                 "param_shapes")
    return Wording(tuple(lines), f"{said}fp32.pt, the fp32 master weights", optimizer,
                   gradient_error="a DeepSpeed universal checkpoint holds no gradients")


def worded(contents: Draft, facts: DeepSpeedFacts) -> Contents:
    """``contents`` finished with the step, the description and the evidence of ``facts``."""
    words = wording(facts)
    contents.step = facts.step if facts.trainer_step is None else facts.trainer_step
    contents.say(replace(words, gradient_error=f"{contents.path}: {words.gradient_error}"))
    return contents.finish()
