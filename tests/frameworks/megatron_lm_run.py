"""A real Megatron-LM run on the CPU, saved in its legacy format by Megatron-LM's own
``save_checkpoint``, and Megatron-LM's own ``load_checkpoint`` of it.

Run with the python of a venv holding megatron-core 0.16.1 and ``regex`` (Megatron-LM's
tokenizer module imports it), from a Megatron-LM checkout at tag ``core_v0.16.1``::

    MEGATRON_LM_PATH=/path/to/Megatron-LM \
        torchrun --nproc-per-node N tests/frameworks/megatron_lm_run.py OUT [tp] [pp] [dp2] \
            [bf16] [tied] [distopt] [uneven] [vp]

Megatron-LM's ``parse_args`` and ``validate_args`` read a command line (2 layers, hidden
16, ``--ckpt-format torch``, ``--save OUT/run``); ``core_transformer_config_from_args``
configures Megatron-core's ``GPTModel`` (its local layer spec: no Transformer Engine), and
Megatron-core builds the optimizer from its own two param groups (decayed, and biases
with the norms not decayed): ``FP32Optimizer`` over torch's AdamW, or with ``bf16``
(the model wrapped in Megatron's ``Float16Module``) ``Float16OptimizerWithFloat16Params``
with fp32 master copies. 3 steps, and after each Megatron-LM's ``save_checkpoint`` writes
``OUT/run/iter_000000N/mp_rank_0R/model_optim_rng.pt`` and the tracker
``latest_checkpointed_iteration.txt``. With ``tp`` the ranks are tensor parallel
(``mp_rank_00``, ``mp_rank_01``; every rank sees the same batch); without it they are data
parallel and only the first writes (``mp_rank_00``). With ``tied`` the output layer
shares the embedding's weight (Megatron's default; untied otherwise). With ``pp`` every rank
is a pipeline stage (``mp_rank_00_00S``, 4 layers; ``uneven``: 3 layers, 1 on the first
stage): each stage builds its part (``pre_process``/``post_process`` as Megatron-LM's
``model_provider`` sets them) wrapped in Megatron's DDP, and a step is Megatron-core's own
1F1B schedule (``get_forward_backward_func``: activations and their gradients sent between
the stages over gloo), its ``finalize_model_grads`` (the tied embedding's gradients
all-reduced between the first and last stages), then the optimizer's step. With both
``tp`` and ``pp`` each stage has 2 tensor-parallel ranks (``mp_rank_0T_00S``). With ``vp``
and ``pp`` the pipeline is virtual (``--num-layers-per-virtual-pipeline-stage 1``: 4 layers,
2 chunks of 1 layer on each of 2 stages): each stage builds one model chunk per virtual
stage as Megatron-LM's ``get_model`` does (``vp_stage``, ``pre_process`` on the first
stage's first chunk, ``post_process`` on the last stage's last chunk, each chunk in its own
DDP, bucketing the first only), one optimizer over the chunks (``get_megatron_optimizer``),
and a step is Megatron-core's interleaved schedule over 2 microbatches; ``save_checkpoint``
writes the chunks as ``model0``, ``model1`` (and with ``distopt`` ``distrib_optim.pt`` one
grad buffer a chunk). With ``dp2``
the model-parallel ranks are half the ranks, twice over: 2 data-parallel replicas (each
sees its own batch), of which the first writes. With ``distopt``, Megatron's distributed
optimizer (``--use-distributed-optimizer``: ``distrib_optim.pt`` beside each file, buckets
of 3000 elements, or ``bucket=N``); over several data-parallel ranks each steps its share
of every bucket.

CPU shims (the only changes to Megatron's behaviour; Megatron asks for CUDA where a CPU
run has none):

* ``torch.tensor(..., device='cuda')`` makes the tensor on the CPU while the optimizer is
  built (its loss-scale and overflow buffers) and while the tracker is read on load, and
  ``Tensor.type()`` names a CPU tensor as ``torch.cuda.*`` while the optimizer is built
  (the float16 optimizer sorts its parameters by those names);
* ``torch.cuda.get_rng_state`` returns the CPU generator's state, and
  ``torch.cuda.set_rng_state`` does nothing (``get_rng_state`` and the load's RNG restore);
* ``torch.cuda.synchronize``/``empty_cache`` do nothing, ``torch.cuda.current_device`` is
  the CPU (the attention's scratch buffer), ``torch.cuda.get_device_properties`` says a
  Hopper GPU (``validate_args`` asks, under tensor parallelism, for advice only);
* Megatron's CUDA RNG tracker forks nothing (no dropout here);
* ``Tensor.cuda()`` returns the tensor while the model is built (a tied last stage moves its
  embedding copy there before the all-reduce from the first stage).

Then, per step, Megatron-LM's ``load_checkpoint`` reads the step back into a freshly built
model and optimizer (``--load OUT/run --ckpt-step N``), and each rank saves
``OUT/reference/iter_N.rankR.pt``: the loaded model's parameters by name, torch's AdamW
state per parameter (found through the parameter objects the optimizer holds, never
through ids; with ``distopt`` each data-parallel rank's piece of each parameter, placed by
the optimizer's own range map and put together: the first data-parallel rank saves), the
fp32 masters with ``bf16``, and Megatron's own
``param_is_not_tensor_parallel_duplicate`` for each parameter (what ``get_grad_norm_fp32``
counts, and with ``pp`` not ``shared``), and with ``pp`` each local layer's global number
from Megatron's own ``layer_number`` (with ``vp``, per chunk, and every name in the record
under its chunk's key, ``model0.`` ...).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron_run import cuda_tensors_on_cpu  # the script beside this one

sys.path.insert(0, os.environ["MEGATRON_LM_PATH"])

STEPS, LAYERS, HIDDEN, HEADS, SEQUENCE, VOCAB = 3, 2, 16, 4, 8, 64
TP = 1
BF16 = False
TIED = False  # ``tied``: the output layer shares the embedding's weight (Megatron's default)
DISTOPT = False  # ``distopt``: Megatron's distributed optimizer, its state in distrib_optim.pt
PP = 1  # ``pp``: every rank a pipeline stage (``mp_rank_00_00S``), 4 layers, 2 a stage
UNEVEN = False  # ``uneven``: with ``pp``, 3 layers, 1 on the first stage (2 on the last)
BUCKET = 3000  # ``bucket=N``: with ``distopt``, a grad-buffer bucket closes at N elements
VP = None  # ``vp``: with ``pp``, 2 virtual stages (model chunks) of 1 layer on each stage
MICROBATCHES = 1  # 2 with ``vp``: the interleaved schedule wants one a stage at least


@contextlib.contextmanager
def without_per_parameter_step():
    """torch's AdamW (the CPU's fallback for Transformer Engine's FusedAdam) keeps ``step``
    per parameter, FusedAdam in its param groups; the distributed optimizer's load copies
    every per-parameter key from distrib_optim.pt, which holds no ``step``: skip it there, as
    on a GPU."""
    if not DISTOPT:
        yield
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = DistributedOptimizer._set_main_param_and_optimizer_states

    def without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[
            self.optimizer.param_groups[group_index]["params"][group_order]
        ]
        step = state.pop("step", None)
        try:
            real(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = without_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = real


def shim_cuda() -> None:
    torch.cuda.get_rng_state = lambda *_, **__: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *_, **__: None
    torch.cuda.synchronize = lambda *_, **__: None
    torch.cuda.empty_cache = lambda *_, **__: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as Megatron's launch scripts set it


def command_line(out: Path, *, step: int | None = None) -> list[str]:
    world = int(os.environ["WORLD_SIZE"])
    line = [
        "pretrain_gpt.py",
        *("--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN)),
        *("--num-attention-heads", str(HEADS), "--seq-length", str(SEQUENCE)),
        *("--max-position-embeddings", str(SEQUENCE), "--vocab-size", str(VOCAB)),
        *("--micro-batch-size", "2"),
        *("--global-batch-size", str(2 * MICROBATCHES * world // (TP * PP))),
        *("--train-iters", str(STEPS), "--lr", "1e-2", "--min-lr", "1e-2"),
        *("--lr-decay-style", "constant", "--weight-decay", "0.1"),
        *("--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8"),
        *("--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "0"),
        *("--tensor-model-parallel-size", str(TP), "--transformer-impl", "local"),
        *("--pipeline-model-parallel-size", str(PP)),
        *("--position-embedding-type", "learned_absolute", "--init-method-std", "0.02"),
        *("--tokenizer-type", "NullTokenizer", "--use-cpu-initialization"),
        *("--ckpt-format", "torch", "--save", str(out / "run"), "--save-interval", "1"),
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm",
    ]
    if BF16:
        line.append("--bf16")
    if UNEVEN:
        line += ["--decoder-first-pipeline-num-layers", "1"]
    if VP:
        line += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if not TIED:
        line.append("--untie-embeddings-and-output-weights")
    if DISTOPT:  # three buckets of at least 3000 elements in the grad buffer
        line += ["--use-distributed-optimizer", "--overlap-grad-reduce"]
        line += ["--ddp-bucket-size", str(BUCKET)]
    if step is not None:
        line += ["--load", str(out / "run"), "--ckpt-step", str(step), "--no-load-rng"]
    return line


def megatron_args(out: Path, *, step: int | None = None):
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.tokenizer import build_tokenizer

    saved = sys.argv
    sys.argv = command_line(out, step=step)
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    # validate_args asks the GPU's architecture under tensor parallelism (for advice only)
    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *_: SimpleNamespace(major=9)
    try:
        validate_args(args)
    finally:
        torch.cuda.get_device_properties = real
    build_tokenizer(args)  # sets args.padded_vocab_size, as Megatron-LM's initialisation does
    global_vars._GLOBAL_ARGS = None
    global_vars.set_args(args)
    calculator.unset_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(
        dist.get_rank(),
        None,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
    )
    return args


def build(args) -> list:
    """The model chunks of this rank: one, or with ``vp`` one per virtual stage, as
    Megatron-LM's ``get_model`` builds them."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage
    from megatron.core.transformer.module import Float16Module
    from megatron.training.arguments import core_transformer_config_from_args

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(TP, PP, virtual_pipeline_model_parallel_size=VP)
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *_, **__: contextlib.nullcontext()
    config = core_transformer_config_from_args(args)
    torch.manual_seed(0)
    real_cuda = torch.Tensor.cuda
    # a tied last stage all-reduces its embedding copy from the first stage's (.cuda() first)
    torch.Tensor.cuda = lambda self, *_, **__: self
    chunks = []
    try:
        for vp_stage in range(VP) if VP else [None]:
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=args.padded_vocab_size,
                max_sequence_length=args.max_position_embeddings,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type,
                # as get_model and model_provider set them
                pre_process=parallel_state.is_pipeline_first_stage()
                and is_vp_first_stage(vp_stage, VP),
                post_process=parallel_state.is_pipeline_last_stage()
                and is_vp_last_stage(vp_stage, VP),
                vp_stage=vp_stage,
            )
            chunk.vp_stage = vp_stage
            chunks.append(chunk)
    finally:
        torch.Tensor.cuda = real_cuda
    if BF16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if DISTOPT or PP > 1:  # the distributed optimizer, and finalize_model_grads, work on DDP
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallelConfig(  # as Megatron-LM's get_model configures it
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            use_distributed_optimizer=DISTOPT,
            overlap_grad_reduce=args.overlap_grad_reduce,
            bucket_size=args.ddp_bucket_size,
        )
        chunks = [
            DistributedDataParallel(config, ddp, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
    return chunks


def optimizer_for(args, chunks):
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_megatron_optimizer_based_on_param_groups,
        _get_param_groups,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        clip_grad=args.clip_grad,
    )
    if DISTOPT or PP > 1:
        from megatron.core.optimizer import get_megatron_optimizer

        config.use_distributed_optimizer = DISTOPT
        with cuda_tensors_on_cpu():
            optimizer = get_megatron_optimizer(config, chunks)
    else:
        with cuda_tensors_on_cpu():
            groups = _get_param_groups(chunks, config, None)
            optimizer = _get_megatron_optimizer_based_on_param_groups(config, chunks, groups)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=0,
        lr_decay_steps=STEPS,
        lr_decay_style="constant",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=STEPS,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def inner(model):
    if DISTOPT or PP > 1:
        model = model.module
    return model.module if BF16 else model


def train(out: Path) -> None:
    from megatron.training.checkpointing import save_checkpoint

    args = megatron_args(out)
    chunks = build(args)
    optimizer, scheduler = optimizer_for(args, chunks)
    g = torch.Generator().manual_seed(1 + dist.get_rank() // TP)  # TP ranks: one batch
    if PP > 1:  # g: each stage sees the batch; the first reads its tokens, the last its labels
        g = torch.Generator().manual_seed(1)
    for iteration in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQUENCE + 1), generator=g)
        position_ids = torch.arange(SEQUENCE).expand(2, SEQUENCE)
        causal = torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).triu(1)[None, None]
        if PP > 1:
            pipelined_step(args, chunks, optimizer, (tokens, position_ids, causal))
            scheduler.step(1)
            save_checkpoint(iteration, chunks, optimizer, scheduler, 0)
            continue
        (model,) = chunks
        loss = model(tokens[:, :-1], position_ids, causal, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        if DISTOPT:
            model.finish_grad_sync()
        for p in model.parameters():
            if p.grad is not None and dist.get_world_size() > TP:  # data parallel
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size() // TP
        with cuda_tensors_on_cpu() if DISTOPT else contextlib.nullcontext():
            optimizer.step()
        scheduler.step(1)
        optimizer.zero_grad()
        if DISTOPT:
            model.zero_grad_buffer()
        save_checkpoint(iteration, [model], optimizer, scheduler, 0)


def pipelined_step(args, chunks, optimizer, batch) -> None:
    """One step through Megatron-core's own 1F1B schedule (interleaved over the chunks with
    ``vp``; activations and their gradients sent between the stages over gloo), its
    ``finalize_model_grads`` (the DDP grad sync and, tied, the first and last stages'
    embedding gradients all-reduced), then the optimizer."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, position_ids, causal = batch

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(tokens[:, :-1], position_ids, causal, labels=tokens[:, 1:])
        return output, lambda output: (output.float().mean(), {})

    config = inner(chunks[0]).config
    config.finalize_model_grads_func = finalize_model_grads
    if VP:  # as Megatron-LM's train does: one no_sync a chunk, one data iterator a chunk
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        data = [iter([None] * MICROBATCHES) for _ in chunks]
    else:
        config.no_sync_func, data = chunks[0].no_sync, iter([None] * MICROBATCHES)
    with cuda_tensors_on_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks,
            num_microbatches=MICROBATCHES,
            seq_length=SEQUENCE,
            micro_batch_size=2,
            forward_only=False,
        )
        optimizer.step()
    optimizer.zero_grad()
    for chunk in chunks:
        chunk.zero_grad_buffer()


def reference(out: Path) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    from megatron.training.checkpointing import load_checkpoint

    (out / "reference").mkdir(exist_ok=True)
    tracker = out / "run" / "latest_checkpointed_iteration.txt"
    for step in range(1, STEPS + 1):
        if DISTOPT and dist.get_rank() == 0:
            # load_checkpoint reads distrib_optim.pt at the tracker's iteration, not at
            # --ckpt-step's (core_v0.16.1): the tracker names each step while it is loaded
            tracker.write_text(str(step))
        dist.barrier()
        args = megatron_args(out, step=step)
        chunks = build(args)
        optimizer, scheduler = optimizer_for(args, chunks)
        with cuda_tensors_on_cpu(), without_per_parameter_step():
            loaded = load_checkpoint(chunks, optimizer, scheduler, strict=True)
        assert loaded[0] == step, loaded
        if DISTOPT or PP > 1:  # get_megatron_optimizer chains one optimizer
            (optimizer,) = optimizer.chained_optimizers
        adam = optimizer.optimizer
        masters = {}
        if (
            BF16 and not DISTOPT
        ):  # the fp32 master copy of each model parameter, in the same group order
            for model_group, main_group in zip(
                optimizer.float16_groups, optimizer.fp32_from_float16_groups
            ):
                for p, main in zip(model_group, main_group):
                    masters[id(p)] = main
        record: dict = {"step": step, "weights": {}, "state": {}, "hyper": {}, "counted": {}}
        if DISTOPT and not VP:  # Megatron's own grad-buffer layout: buckets, padding
            (model,) = chunks
            record["buckets"] = [len(b.buckets) for b in model.buffers]
            record["buffer_numel"] = [b.numel for b in model.buffers]
            (buffer,) = model.buffers
            by_param = {p: n for n, p in inner(model).named_parameters()}
            # each parameter's (start, end) in distrib_optim.pt's flat tensors: its place in
            # the grad buffer less the padding ending the buckets before it
            dropped = [
                start - sum(b.numel_unpadded for b in buffer.buckets[:i])
                for i, (start, _) in enumerate(buffer.bucket_indices)
            ]
            record["places"] = {
                by_param[p]: (start - dropped[bucket], end - dropped[bucket])
                for p, (start, end, bucket) in buffer.param_index_map.items()
            }
        # with vp, each chunk's names under its key in the file (model0, model1...)
        keys = [f"model{i}." for i in range(VP)] if VP else [""]
        named = [
            (key + name, p)
            for key, chunk in zip(keys, chunks)
            for name, p in inner(chunk).named_parameters()
        ]
        pieces = _distributed_pieces(dict(named), optimizer, adam) if DISTOPT else {}
        for name, p in named:
            held = masters.get(id(p), p)
            record["weights"][name] = p.detach().clone()
            if DISTOPT:  # the main (fp32) shards the data-parallel ranks step, put together
                whole, hyper = _whole(pieces[name], p.numel())
                record.setdefault("masters", {})[name] = whole["param"].view(p.shape)
                record["state"][name] = {
                    "exp_avg": whole["exp_avg"].view(p.shape),
                    "exp_avg_sq": whole["exp_avg_sq"].view(p.shape),
                    "step": hyper.pop("step"),
                }
                record["hyper"][name] = hyper
            else:
                if BF16:
                    record.setdefault("masters", {})[name] = held.detach().clone().view(p.shape)
                state = adam.state[held]
                record["state"][name] = {
                    "exp_avg": state["exp_avg"].clone().view(p.shape),
                    "exp_avg_sq": state["exp_avg_sq"].clone().view(p.shape),
                    "step": float(state["step"]),
                }
                group = next(g for g in adam.param_groups if any(q is held for q in g["params"]))
                record["hyper"][name] = _hyper(group)
            record["counted"][name] = bool(param_is_not_tensor_parallel_duplicate(p)) and (
                param_is_not_shared(p)  # a tied last stage's embedding copy: not counted
            )
        # each stage's layers under their global numbers, as Megatron's layers know them
        numbers = [[layer.layer_number - 1 for layer in inner(c).decoder.layers] for c in chunks]
        record["layer_numbers"] = numbers if VP else numbers[0]
        record["stage"] = parallel_state.get_pipeline_model_parallel_rank()
        record["data_parallel"] = parallel_state.get_data_parallel_world_size()
        if parallel_state.get_data_parallel_rank() == 0:  # one record a model-parallel rank
            torch.save(record, out / "reference" / f"iter_{step}.rank{dist.get_rank()}.pt")
        dist.barrier()
    if DISTOPT and dist.get_rank() == 0:
        tracker.write_text(str(STEPS))


_TENSORS = ("param", "exp_avg", "exp_avg_sq")


def _hyper(group: dict) -> dict:
    return {"lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"]}


def _distributed_pieces(named: dict, optimizer, adam) -> dict[str, list]:
    """Every data-parallel rank's shard of each parameter (``named``: name -> parameter),
    gathered over the data-parallel group: ``{name: [(start, end, {"param", "exp_avg",
    "exp_avg_sq"}, hyper)]}``, each piece placed within its parameter by Megatron's own range
    map (``_get_model_param_range_map``) and read through its own
    ``_get_main_param_and_optimizer_states``."""
    from megatron.core import parallel_state

    names = {p: n for n, p in named.items()}
    mine = {}
    for p, name in names.items():
        if p not in optimizer.model_param_gbuf_map:  # no element of p on this rank
            continue
        where = optimizer._get_model_param_range_map(p)["param"]
        tensors = optimizer._get_main_param_and_optimizer_states(p)
        group_index, group_order = optimizer.model_param_group_index_map[p]
        group = adam.param_groups[group_index]
        step = adam.state[group["params"][group_order]]["step"]
        piece = {k: tensors[k].detach().clone().reshape(-1) for k in _TENSORS}
        mine[name] = (where.start, where.end, piece, {**_hyper(group), "step": float(step)})
    gathered = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(gathered, mine, group=parallel_state.get_data_parallel_group_gloo())
    out: dict[str, list] = {}
    for one in gathered:
        for name, piece in one.items():
            out.setdefault(name, []).append(piece)
    return out


def _whole(pieces: list, numel: int) -> tuple[dict, dict]:
    """A parameter's pieces side by side: each element from exactly one rank, one step and
    hyperparameters."""
    pieces = sorted(pieces, key=lambda piece: piece[0])
    assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]], pieces
    assert pieces[-1][1] == numel and len({repr(p[3]) for p in pieces}) == 1
    whole = {k: torch.cat([p[2][k] for p in pieces]) for k in _TENSORS}
    return whole, dict(pieces[0][3])


if __name__ == "__main__":
    target = Path(sys.argv[1])
    world, flags = int(os.environ["WORLD_SIZE"]), sys.argv[2:]
    # tp (or pp): every model-parallel rank a tensor-parallel rank (a pipeline stage); both:
    # 2 tensor-parallel ranks a stage; dp2: two data-parallel replicas (without tp and pp
    # every rank is a data-parallel one)
    parallel = world // 2 if "dp2" in flags else world
    TP = (2 if "pp" in flags else parallel) if "tp" in flags else 1
    PP = parallel // TP if "pp" in flags else 1
    BF16 = "bf16" in flags
    TIED = "tied" in flags
    DISTOPT = "distopt" in flags
    UNEVEN = "uneven" in flags
    BUCKET = next((int(f[len("bucket=") :]) for f in flags if f.startswith("bucket=")), BUCKET)
    LAYERS = (3 if UNEVEN else 4) if PP > 1 else LAYERS
    if "vp" in flags:
        assert PP == 2 and not UNEVEN, "vp: 2 stages, an even split"
        VP, MICROBATCHES = 2, 2
    shim_cuda()
    dist.init_process_group("gloo")
    try:
        from megatron.core import parallel_state

        train(target)
        reference(target)
    finally:
        parallel_state.destroy_model_parallel() if "parallel_state" in dir() else None
        dist.destroy_process_group()
