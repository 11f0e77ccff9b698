"""A real Megatron-core run on the CPU, saved as ``torch_dist``, and Megatron's own load of it.

Run in the frameworks venv (megatron-core 0.16.1, see ``.ci/run``)::

    torchrun --nproc-per-node N tests/frameworks/megatron_run.py OUT

Megatron-core's ``GPTModel`` (its local layer spec: no Transformer Engine;
2 layers, CPU initialisation) trains 3 AdamW steps through Megatron's
``FP32Optimizer`` (torch's AdamW inside); with 2 ranks the ranks are data
parallel (gloo), the gradients averaged by hand. After each step the state
dict Megatron-LM's ``save_checkpoint`` builds (``model`` and ``optimizer``
as the model's and the optimizer's ``sharded_state_dict``, ``iteration``,
``args``, ``checkpoint_version``) is written by Megatron-core's own
``dist_checkpointing.save`` to ``OUT/run/iter_000000N/`` (torch_dist:
``.metadata``, ``*.distcp``, ``common.pt``, ``metadata.json``), and the
tracker ``latest_checkpointed_iteration.txt`` names the newest, as
Megatron-LM's ``save_checkpoint`` names them (Megatron-LM itself, with its
``megatron/training``, is not on PyPI).

Shims for the CPU, as the issue describes: ``FP32Optimizer`` puts its unit
loss scale on ``cuda`` (made on the CPU here), Megatron's RNG tracker forks
nothing (no dropout), and its attention's scratch buffer asks for
``torch.cuda.current_device()`` (the CPU here) and the ``torch_dist`` writer
calls ``torch.cuda.synchronize()`` (nothing to wait for here).

With ``tp`` after OUT the ranks are tensor parallel instead (Megatron splits
the attention and MLP matrices across them; every rank sees the same batch).
With ``distopt`` they are data parallel through Megatron's own DDP (its grad
buffers, buckets of 3000 elements, or N with ``bucket=N``) and distributed optimizer
(``get_megatron_optimizer``, each rank stepping its share of every bucket; the
shims also make its ``device='cuda'`` buffers on the CPU and name CPU tensors
``torch.cuda.*`` as it sorts them), saved as Megatron-LM's ``save_checkpoint``
asks for them by default (the unwrapped model's sharded dict; the optimizer's
with ``distrib_optim_sharding_type`` ``dp_reshardable``: each bucket's flat
state under ``optimizer.distributed.``). Its reference adds the moments as the
distributed optimizer holds them once its own ``load_state_dict`` has read the
loaded buckets: each rank's range of every parameter, gathered whole
(``distopt.<name>.exp_avg``, ``.exp_avg_sq``), and the param groups' step,
betas, lr and eps (``distopt.step``...). ``distopt tp`` makes the ranks tensor parallel
with the distributed optimizer (each rank's buckets its own, ``dp_group_idx_<tp rank>``;
its reference its own shards' moments, gathered over its data-parallel group); ``pp``
makes them 2 pipeline stages (a layer each, the micro-batch's activations and their
gradients sent between them by hand, as Megatron's schedules set a stage's input with
``set_input_tensor``), each rank's reference its own stage's. ``tp=2 pp=2`` on 4 ranks
makes both: 2 stages of 2 tensor-parallel ranks each (Megatron's rank order, tensor
parallelism fastest), each rank's reference its own shards of its own stage.
``bf16`` trains in mixed precision as Megatron-LM's ``--bf16`` sets it up (``bf16`` and
``params_dtype`` in the transformer config, the model wrapped in ``Float16Module`` and
Megatron's DDP with fp32 gradient reduction, ``get_megatron_optimizer`` with
``bf16=True``): bf16 model tensors and fp32 main params, saved by the plain optimizer
(``Float16OptimizerWithFloat16Params``) as ``optimizer.state.fp32_param.<name>`` and by
the distributed one as its buckets' ``param``; the distributed optimizer's reference then
has each main param too (``distopt.<name>.param``). ``fully`` saves the distributed
optimizer's state as Megatron-LM's ``--dist-ckpt-optim-fully-reshardable`` does
(``distrib_optim_sharding_type`` ``fully_reshardable``: each parameter's
``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>`` in the model's shape, gathered over
the data-parallel ranks; the shims also keep its gather's ``.cuda()`` copies on the CPU);
its reference is the state Megatron's ``dist_checkpointing.load`` gives, under the same
``distopt.*`` names.
``moe`` makes each layer's MLP a Mixture of Experts (``num_moe_experts`` 4, the local
spec's ``SequentialMLP`` of local MLPs, a top-2 router with its all-gather token dispatcher
and a load-balancing loss; no biases in the linear layers, as MoE models train); Megatron
saves each expert stacked by layer and by its global expert index (two prepended axes:
``decoder.layers.mlp.experts.experts.linear_fc1.weight``, ``[layers, experts, ...]``), the
router as ``decoder.layers.mlp.router.weight``. A CPU shim more: without Transformer Engine
megatron-core 0.16.1 leaves the router's ``te_general_gemm`` undefined where it asks
whether it is None (set to None: its torch.mm path). ``moe ep`` makes the ranks expert
parallel too (``expert_model_parallel_size`` N: each rank holds 4/N of every layer's
experts, saved as its chunks of the expert axis, and is data parallel for the rest),
trained as Megatron-LM trains it: Megatron's DDP (the experts' gradients in expert buffers,
reduced over the expert data-parallel group) and ``get_megatron_optimizer``'s
``ChainedOptimizer`` of the dense parameters' optimizer and the experts' (``common.pt``'s
``optimizer`` ``{0: ..., 1: ...}``; with ``distopt`` their buckets under ``chained_0.`` and
``chained_1.``, with ``fully`` their state per parameter); each rank's reference is then
its own, as under tensor parallelism, each chained optimizer's state keyed by its own ids
(``optimizer.<k>.state.<id>``, named by ``param_names.<k>``). ``moe bias`` adds the
router's expert bias (``moe_router_enable_expert_bias``, sigmoid scores: aux-loss-free
balancing), a buffer Megatron saves beside the router's weight
(``decoder.layers.mlp.router.expert_bias``), updated after each backward as Megatron's
``finalize_model_grads`` updates it; the reference lists the model's buffers
(``buffer_names``, torch's ``named_buffers``). ``moe dense1`` makes layer 0
a dense MLP (``moe_layer_freq`` ``[0, 1]``, the decoder block's local spec per layer):
Megatron then saves each layer under its number
(``decoder.layers.1.mlp.experts.experts.linear_fc1.weight``, the expert axis first).

Then Megatron's own ``dist_checkpointing.load`` reads each step back into
the sharded state dict of a freshly built model and optimizer, saved as
``OUT/reference/iter_N.pt`` (plain tensors, by Megatron's names; the moments
by parameter id, with ``param_names`` naming each id by Megatron's own id-to-sharded-tensor map).
Tensor (or expert) parallel, each rank saves ``iter_N.rankR.pt``: its own shards, and a
replicated tensor only where it is Megatron's main replica. An expert is named by its
layer and its global expert index, as Megatron's ``singleton_local_shards`` keys name it
(``decoder.layers.0.mlp.experts.experts.3.linear_fc1.weight``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQUENCE, STEPS, LAYERS, HIDDEN, HEADS = 64, 8, 3, 2, 16, 4  # a caller may enlarge them
TP = 1  # tensor-parallel ranks: ``tp`` after OUT makes every rank one (argv)
PP = 1  # pipeline stages: ``pp`` after OUT makes every rank one (argv)
DISTOPT = False  # ``distopt`` after OUT: Megatron's distributed optimizer over the ranks
BUCKET = 3000  # ``bucket=N`` after ``distopt``: a grad-buffer bucket closes at N elements
BF16 = False  # ``bf16`` after OUT: mixed precision, bf16 weights and fp32 main params
EXPERTS = 0  # ``moe`` after OUT: each layer's MLP a router and this many experts (4)
EP = 1  # expert-parallel ranks: ``ep`` after ``moe`` makes every rank one (argv)
DENSE_FIRST = False  # ``dense1`` after ``moe``: layer 0 a dense MLP, the rest MoE
EXPERT_BIAS = False  # ``bias`` after ``moe``: the router's expert bias (a buffer), sigmoid scores
# Megatron-LM's default for the distributed optimizer under torch_dist (checkpointing.py's
# _build_sharded_state_dict_metadata, without --dist-ckpt-optim-fully-reshardable)
SHARDING = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def build():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    if EXPERTS:
        from megatron.core.transformer.moe import moe_utils

        # Without Transformer Engine, megatron-core 0.16.1 leaves the router's te_general_gemm
        # undefined (imported only with TE) where it asks whether it is None: None, its own
        # torch.mm path.
        moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(TP, PP, expert_model_parallel_size=EP)
        # No dropout here, and no CUDA RNG to fork: Megatron's tracker forks nothing.
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *_, **__: contextlib.nullcontext()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        init_method_std=0.02,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        pipeline_model_parallel_size=PP,
        pipeline_dtype=torch.bfloat16 if BF16 else torch.float32,
        bf16=BF16,  # as Megatron-LM's --bf16 sets it (its params_dtype too)
        params_dtype=torch.bfloat16 if BF16 else torch.float32,
        **(_moe() if EXPERTS else {}),
    )
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config),
        vocab_size=VOCAB,
        max_sequence_length=SEQUENCE,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if BF16:  # as Megatron-LM's get_model wraps it: the module's parameters made bf16
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if wrapped():  # the distributed, bf16 and expert-parallel optimizers work on Megatron's DDP
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,  # Megatron-LM's default under --bf16
            use_distributed_optimizer=DISTOPT,
            overlap_grad_reduce=True,
            bucket_size=BUCKET,  # several buckets
        )
        model = DistributedDataParallel(config, ddp, model)
    return model


def _layer_spec(config):
    """The local spec (no Transformer Engine): every layer's, or with ``dense1`` the decoder
    block's, a spec per layer (``moe_layer_freq``: layer 0 dense, layer 1 MoE)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if DENSE_FIRST:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return get_gpt_layer_local_spec(num_experts=EXPERTS or None)


def _moe() -> dict:
    """The transformer config's MoE settings: a top-2 router over the experts (Megatron's
    SequentialMLP of local MLPs under the local spec), its all-gather token dispatcher, a
    load-balancing loss that reaches the router's gradient; no biases in the linear layers,
    as MoE models train (Megatron-LM's Mixtral recipe: ``--disable-bias-linear``)."""
    return {
        "add_bias_linear": False,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 32,
        "moe_token_dispatcher_type": "allgather",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
        "expert_model_parallel_size": EP,
        **({"moe_layer_freq": [0] + [1] * (LAYERS - 1)} if DENSE_FIRST else {}),
        **(
            {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}
            if EXPERT_BIAS
            else {}
        ),
    }


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """The distributed optimizer's buffers (and its grad norm's) ask for ``device='cuda'``,
    and it sorts its parameters by ``Tensor.type()`` names (``torch.cuda.*``): made and named
    here as on a GPU, on the CPU."""
    real, real_type, real_zeros = torch.tensor, torch.Tensor.type, torch.zeros

    def on_cpu(*args, device=None, **kwargs):
        return real(*args, **kwargs)

    def zeros_on_cpu(*args, device=None, **kwargs):  # the grad norm's overflow buffer
        return real_zeros(*args, **kwargs)

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    real_cuda = torch.Tensor.cuda  # fully_reshardable's gather sends "cuda" copies
    torch.tensor, torch.Tensor.type, torch.zeros = on_cpu, cuda_type, zeros_on_cpu
    torch.Tensor.cuda = lambda self, *_, **__: self
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.type, torch.zeros = real, real_type, real_zeros
        torch.Tensor.cuda = real_cuda


def optimizer_for(model):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    if wrapped():
        from megatron.core.optimizer import get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=0.0,
            bf16=BF16,  # Float16OptimizerWithFloat16Params, or the distributed one's fp32 mains
            use_distributed_optimizer=DISTOPT,
        )
        with cuda_tensors_on_cpu():
            return get_megatron_optimizer(config, [model])

    adamw = torch.optim.AdamW(
        model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0)
    real_tensor = torch.tensor

    def on_cpu(*args, device=None, **kwargs):  # FP32Optimizer's loss scale says 'cuda'
        return real_tensor(*args, **kwargs)

    torch.tensor = on_cpu
    try:
        return FP32Optimizer(adamw, config, init_state_fn=lambda *_: None)
    finally:
        torch.tensor = real_tensor


def wrapped() -> bool:
    """Whether the model is wrapped in Megatron's DDP (its grad buffers) and optimized by
    ``get_megatron_optimizer`` (under expert parallelism, as Megatron-LM trains it: a
    ``ChainedOptimizer`` of the dense parameters' optimizer and the experts')."""
    return DISTOPT or BF16 or EP > 1


def state_dict(model, optimizer, iteration: int, *, is_loading: bool = False) -> dict:
    if wrapped():  # as Megatron-LM's save_checkpoint asks for them (checkpointing.py)
        from megatron.core import parallel_state

        # the optimizer's sharding type only for the distributed one (Megatron-LM's metadata)
        sharding = {k: v for k, v in SHARDING.items() if DISTOPT or "distrib" not in k}
        metadata = {
            **sharding,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
        }
        model_sd = model.module.sharded_state_dict(metadata=metadata)  # unwrapped, as saved
        if optimizer is None:
            optimizer_sd = None
        else:
            with cuda_tensors_on_cpu():
                optimizer_sd = optimizer.sharded_state_dict(
                    {"model": model_sd}, is_loading=is_loading, metadata=metadata
                )
    else:
        model_sd = model.sharded_state_dict()
        optimizer_sd = optimizer.sharded_state_dict(model_sd)
    args = argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        lr=1e-2,
        adam_beta1=0.9,
        adam_beta2=0.95,
        iteration=iteration,
        ckpt_format="torch_dist",
    )
    return {
        "model": model_sd,
        **({"optimizer": optimizer_sd} if optimizer_sd is not None else {}),
        "iteration": iteration,
        "args": args,
        "checkpoint_version": 3.0,
    }


def main(out: Path, *, with_reference: bool = True) -> None:
    from megatron.core import dist_checkpointing

    torch.cuda.current_device = lambda: torch.device("cpu")  # the attention's scratch buffer
    torch.cuda.synchronize = lambda *_: None  # the torch_dist writer's preload

    from megatron.core import parallel_state

    model = build()
    optimizer = optimizer_for(model)
    # Model-parallel ranks see one batch, data-parallel ones their own.
    g = torch.Generator().manual_seed(1 + parallel_state.get_data_parallel_rank())
    run = out / "run"
    run.mkdir(parents=True, exist_ok=True)
    for iteration in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQUENCE + 1), generator=g)
        position_ids = torch.arange(SEQUENCE).expand(2, SEQUENCE)
        causal = torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).triu(1)[None, None]
        if PP > 1:
            _pipelined(model, tokens, position_ids, causal)
        else:
            loss = model(tokens[:, :-1], position_ids, causal, labels=tokens[:, 1:]).float().mean()
            loss.backward()
        if wrapped():  # Megatron's DDP reduces (or reduce-scatters) each bucket's gradients
            model.finish_grad_sync()
        if EXPERT_BIAS:  # as Megatron's finalize_model_grads updates it, from the tokens routed
            from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

            _update_router_expert_bias([model], (model.module if wrapped() else model).config)
        for p in model.parameters():
            if p.grad is not None and dist.get_world_size() > TP * PP:  # data parallel
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        with cuda_tensors_on_cpu() if wrapped() else contextlib.nullcontext():
            optimizer.step()
        optimizer.zero_grad()
        if wrapped():
            model.zero_grad_buffer()
        folder = run / f"iter_{iteration:07d}"
        if dist.get_rank() == 0:
            folder.mkdir()
        dist.barrier()
        dist_checkpointing.save(state_dict(model, optimizer, iteration), str(folder))
        if dist.get_rank() == 0:
            (run / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        dist.barrier()
    if with_reference:
        reference(out)


def _pipelined(model, tokens, position_ids, causal) -> None:
    """One micro-batch through 2 pipeline stages by hand (gloo send and receive): the first
    stage's output is the second's input (``set_input_tensor``, as Megatron's schedules set
    it), the loss on the last, its gradient sent back."""
    from megatron.core import parallel_state

    inner = model.module if wrapped() else model
    shape = (SEQUENCE, tokens.shape[0], HIDDEN)  # Megatron's [sequence, batch, hidden]
    dtype = torch.bfloat16 if BF16 else torch.float32
    if parallel_state.is_pipeline_first_stage():
        following = parallel_state.get_pipeline_model_parallel_next_rank()
        hidden = model(tokens[:, :-1], position_ids, causal)
        dist.send(hidden.detach().contiguous(), following)
        grad = torch.empty(shape, dtype=dtype)
        dist.recv(grad, following)
        hidden.backward(grad)
    else:
        preceding = parallel_state.get_pipeline_model_parallel_prev_rank()
        received = torch.empty(shape, dtype=dtype)
        dist.recv(received, preceding)
        received.requires_grad_()
        inner.set_input_tensor(received)
        loss = model(None, position_ids, causal, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        dist.send(received.grad.contiguous(), preceding)


def reference(out: Path) -> None:
    """Megatron's own load of each step into a fresh model's and optimizer's sharded dicts."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    (out / "reference").mkdir(exist_ok=True)
    for iteration in range(1, STEPS + 1):
        model = build()
        if wrapped():  # loaded as Megatron-LM loads it: the sharded dict asked for loading
            ddp = model
            optimizer = optimizer_for(model)
            with cuda_tensors_on_cpu():  # a step on zero gradients makes the state to load into
                optimizer.step()
            wanted = state_dict(model, optimizer, iteration, is_loading=True)
            model = model.module
        else:
            optimizer = optimizer_for(model)
            # Fill the optimizer's state so that its sharded dict lists every moment to load.
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()
            wanted = state_dict(model, optimizer, iteration)
        main: dict = {}
        _main_replicas(wanted, "", main)
        # expert parallel, distributed: a ChainedOptimizer's, {0: the dense one's, 1: the experts'}
        chain = wanted.get("optimizer") if DISTOPT and EP > 1 else {0: wanted.get("optimizer")}
        names = {k: _state_names(part or {}) for k, part in chain.items()}
        loaded = dist_checkpointing.load(wanted, str(out / "run" / f"iter_{iteration:07d}"))
        flat: dict = {}
        if DISTOPT:  # the optimizer's own state once it has loaded its buckets
            optimizer_sd = loaded.pop("optimizer")
            parts = optimizer_sd if EP > 1 else {0: optimizer_sd}
            (sharding,) = {part["param_state_sharding_type"] for part in parts.values()}
            flat["optimizer.param_state_sharding_type"] = sharding
            if sharding == "fully_reshardable":
                for k, part in parts.items():
                    found = _fully_reshardable(names[k], part)
                    assert all(flat[h] == found[h] for h in found if h in flat)  # one step...
                    flat.update(found)
            else:
                with cuda_tensors_on_cpu(), torch.no_grad():  # it copies into the main params
                    optimizer.load_state_dict(optimizer_sd)
                flat.update(_distributed_moments(ddp, optimizer))
        _flatten(loaded, "", flat)
        if TP * PP * EP > 1:  # each rank's own shards, a replicated one from its main replica alone
            flat = {k: v for k, v in flat.items() if main.get(k, True)}
        # The optimizer's state is keyed by parameter id: Megatron's own map from ids to its
        # sharded tensors names each, a stacked one by its layer (its prepended offset).
        model_sd = model.sharded_state_dict()
        chained = getattr(optimizer, "chained_optimizers", [])
        if not DISTOPT and len(chained) > 1:  # expert parallel: the dense and the experts' own
            assert not BF16
            # Each one's state (``optimizer.<k>.state.<id>``) by its own parameters' ids
            for k, part in enumerate(chained):
                ids = get_param_id_to_sharded_param_map(model_sd, part.get_parameters())
                flat[f"param_names.{k}"] = [_layer_name(ids[i]) for i in range(len(ids))]
        elif not DISTOPT:
            # bf16: the ids are the fp32 mains' (torch's optimizer over them), in the order
            # of the model's bf16 parameters they are made from (float16_groups)
            params = (
                itertools.chain.from_iterable(optimizer.chained_optimizers[0].float16_groups)
                if BF16
                else optimizer.get_parameters()
            )
            ids = get_param_id_to_sharded_param_map(model_sd, params)
            flat["param_names"] = [_layer_name(ids[i]) for i in range(len(ids))]
        # The model's state-dict names (the loaded dict's keys) by their sharded tensors' too.
        flat["model_names"] = {
            k: _layer_name(v) for k, v in model_sd.items() if isinstance(v, ShardedTensor)
        }
        # Those of its buffers (torch's own word: the router's expert bias), never parameters
        flat["buffer_names"] = [
            flat["model_names"][k] for k, _ in model.named_buffers() if k in flat["model_names"]
        ]
        if TP * PP * EP > 1:
            torch.save(flat, out / "reference" / f"iter_{iteration}.rank{dist.get_rank()}.pt")
        elif dist.get_rank() == 0:
            torch.save(flat, out / "reference" / f"iter_{iteration}.pt")
        dist.barrier()


def _state_names(optimizer: dict) -> dict:
    """``{parameter index: {state key: name}}`` of a ``fully_reshardable`` optimizer's
    sharded dict (``optimizer.state.<key>.<name>`` tensors), a stacked one's by its layer;
    empty for another."""
    if optimizer.get("param_state_sharding_type") != "fully_reshardable":
        return {}
    return {
        index: {
            key: _layer_name(tensor).removeprefix(f"optimizer.state.{key}.")
            for key, tensor in tensors.items()
        }
        for index, tensors in optimizer["param_state"].items()
    }


def _fully_reshardable(names: dict, optimizer_sd: dict) -> dict:
    """A ``fully_reshardable`` optimizer's state as Megatron's own ``dist_checkpointing.load``
    gives it (each parameter's main param and moments in the model's shape, the step in the
    param groups), as ``_distributed_moments`` names it: ``distopt.<name>.<key>``,
    ``distopt.step``... (The optimizer's own ``load_state_dict`` of it fails on the CPU:
    it copies every key of torch AdamW's state, the per-parameter ``step`` among them,
    from the saved tensors, which hold none.)"""
    out = {
        f"distopt.{names[index][key]}.{key}": value.detach().clone()
        for index, tensors in optimizer_sd["param_state"].items()
        for key, value in tensors.items()
    }
    groups = optimizer_sd["optimizer"]["param_groups"]
    (hyper,) = {(g["step"], *g["betas"], g["lr"], g["eps"]) for g in groups}
    out.update(
        zip(("distopt.step", "distopt.beta1", "distopt.beta2", "distopt.lr", "distopt.eps"), hyper)
    )
    return out


def _distributed_moments(ddp, optimizer) -> dict:
    """Each parameter's moments as the distributed optimizer holds them after its own load,
    gathered over its data-parallel group (each of its ranks holds a range of every bucket;
    under expert parallelism the experts' optimizer's group is the expert data-parallel one):
    ``distopt.<name>.{param,exp_avg,exp_avg_sq}`` (its fp32 main param and moments) whole
    (tensor parallel: this rank's shard of it, as its buckets hold it), by Megatron's sharded
    names, and the param groups' ``step``, ``betas``, ``lr`` and ``eps``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    names = {
        v.data.data_ptr(): _layer_name(v)
        for v in ddp.module.sharded_state_dict().values()
        if isinstance(v, ShardedTensor)
    }
    shapes = {
        _layer_name(v): torch.Size(v.local_shape)
        for v in ddp.module.sharded_state_dict().values()
        if isinstance(v, ShardedTensor)
    }
    out: dict = {}
    # get_megatron_optimizer's one, or under expert parallelism the dense parameters' and the
    # experts' (each over its own data-parallel group: the experts' is the expert one)
    for part in optimizer.chained_optimizers:
        mine = []  # (name, start in the flattened parameter, main param, exp_avg, exp_avg_sq)
        for ranges in part.gbuf_ranges:
            for per_bucket in ranges.values():
                for bucket in per_bucket:
                    for param, where in bucket["param_map"].items():
                        state = part._get_main_param_and_optimizer_states(param)
                        mine.append(
                            (
                                names[param.data_ptr()],
                                where["param"].start,
                                state["param"].detach().clone(),
                                state["exp_avg"].detach().clone(),
                                state["exp_avg_sq"].detach().clone(),
                            )
                        )
        group = part.data_parallel_group
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        for name in {n for rank in every for n, *_ in rank}:
            shape = shapes[name]
            pieces = sorted((s, p, a, b) for rank in every for n, s, p, a, b in rank if n == name)
            for i, key in ((1, "param"), (2, "exp_avg"), (3, "exp_avg_sq")):
                whole = torch.cat([p[i] for p in pieces])
                assert [p[0] for p in pieces][0] == 0 and whole.numel() == shape.numel()
                out[f"distopt.{name}.{key}"] = whole.view(shape)
    buffers = {b.data_ptr() for b in ddp.module.buffers()}  # no moments: not parameters
    assert {k.rsplit(".", 1)[0] for k in out} == {
        f"distopt.{n}" for ptr, n in names.items() if ptr not in buffers
    }
    # One step and one set of hyperparameters over the groups (else the reference is wrong).
    groups = [g for part in optimizer.chained_optimizers for g in part.param_groups]
    (hyper,) = {(g["step"], *g["betas"], g["lr"], g["eps"]) for g in groups}
    out.update(
        zip(("distopt.step", "distopt.beta1", "distopt.beta2", "distopt.lr", "distopt.eps"), hyper)
    )
    return out


def _layer_name(sharded) -> str:
    """A sharded tensor's key, a stacked one's with its layer (the prepended offset) in it,
    an expert's (SequentialMLP's second prepended axis) also with its global expert index, as
    Megatron's ``singleton_local_shards`` keys name it (``...experts.experts.3.linear_fc1``)."""
    name, axis = sharded.key, 0
    if re.match(r"(.*\.)?layers\.(?!\d)", name):  # stacked (layers differing: numbered)
        name = name.replace("layers.", f"layers.{sharded.global_offset[axis]}.", 1)
        axis += 1
    if re.match(r".*\.experts\.experts\.(?!\d)", name):
        name = name.replace(".experts.experts.", f".experts.experts.{sharded.global_offset[axis]}.")
        axis += 1
    assert axis == sharded.prepend_axis_num, sharded.key
    return name


def _main_replicas(value, prefix: str, out: dict) -> None:
    """``{dotted name: whether this rank holds the main replica}`` of each sharded tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    if isinstance(value, dict):
        for k, v in value.items():
            _main_replicas(v, f"{prefix}{k}.", out)
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            _main_replicas(v, f"{prefix}{i}.", out)
    elif isinstance(value, ShardedTensor):
        out[prefix[:-1]] = is_main_replica(value.replica_id)


def _flatten(value, prefix: str, flat: dict) -> None:
    """A loaded state dict as ``{dotted name: tensor or plain value}``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}{k}.", flat)
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}{i}.", flat)
    elif isinstance(value, torch.Tensor):
        flat[prefix[:-1]] = value.detach().clone()
    elif isinstance(value, ShardedTensor):
        raise AssertionError(f"{prefix} was not loaded")
    elif isinstance(value, (int, float, str, bool)) or value is None:
        flat[prefix[:-1]] = value


if __name__ == "__main__":
    target = Path(sys.argv[1])
    for flag in sys.argv[2:]:
        if flag in ("tp", "pp") or flag.startswith(("tp=", "pp=")):  # tp=2 pp=2: 2 x 2
            size = int(flag[3:]) if "=" in flag else int(os.environ["WORLD_SIZE"])
            TP, PP = (size, PP) if flag.startswith("tp") else (TP, size)
        elif flag == "distopt":
            DISTOPT = True
        elif flag == "bf16":
            BF16 = True
        elif flag == "moe":
            EXPERTS = 4
        elif flag == "dense1":
            DENSE_FIRST = True
        elif flag == "bias":
            EXPERT_BIAS = True
        elif flag == "ep":  # every rank an expert-parallel rank
            EP = int(os.environ["WORLD_SIZE"])
        elif flag == "fully":  # Megatron-LM's --dist-ckpt-optim-fully-reshardable
            SHARDING["distrib_optim_sharding_type"] = "fully_reshardable"
        else:
            BUCKET = int(flag.removeprefix("bucket="))
    dist.init_process_group("gloo")
    try:
        main(target)
    finally:
        dist.destroy_process_group()
