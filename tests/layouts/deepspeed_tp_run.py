"""Real DeepSpeed checkpoints of two tensor-parallel ranks, written by DeepSpeed's own CPU run.

``python -m tests.layouts.deepspeed_tp_run OUT`` starts 2 processes (gloo, the
CPU accelerator), then 4: tensor-parallel groups of 2, data parallelism 1 then 2, given
to ``deepspeed.initialize(mpu=...)`` as a model-parallel unit with DeepSpeed's
interface (``ModelParallelUnit``), so that ``engine.save_checkpoint`` writes
``mp_rank_00_*`` and ``mp_rank_01_*`` files. The model is the user's code, as
Megatron-DeepSpeed's is: a tiny GPT whose linear layers tensor parallelism
splits as Megatron does (column-parallel qkv and fc1, their outputs' rows;
row-parallel proj and fc2, their inputs' columns, all-reduced in forward;
a vocabulary-parallel embedding and output layer) beside replicated layer
norms, position embeddings and row-parallel biases. Runs (``RUNS``):

* ``zero1_core/``: ZeRO 1, Megatron-core's names (``decoder.layers.0.self_attention
  .linear_qkv``...), saved at steps 2 and 3 (``global_step2/``, ``global_step3/``);
* ``zero2_legacy/``: ZeRO 2, legacy Megatron's names as Megatron-DeepSpeed's
  models carry them (``language_model.encoder.layers.0.self_attention
  .query_key_value``...), with Megatron-DeepSpeed's ``client_state`` (``args`` an
  ``argparse.Namespace``, ``iteration``);
* ``zero1_plain/``: ZeRO 1, the same model under names that say nothing of how
  tensor parallelism splits it (``blocks.0.attn.qkv``...);
* ``zero3_core/``: ZeRO 3 (``zero_pp_rank_0_mp_rank_0X_model_states.pt``), Megatron-core's
  names;
* ``zero0_core/``: without ZeRO (stage 0): each rank's ``mp_rank_0X_model_states.pt``
  holds its module and torch's AdamW state dict, Megatron-core's names; ``zero0_bf16/``
  the same in bf16 mixed precision (DeepSpeed's ``FP16_UnfusedOptimizer``: fp32 master
  weights beside the bf16 module, the reference's weights the masters);
* ``zero2_dp2/``: ZeRO 2 on 4 processes, tensor parallelism 2 x data parallelism 2
  (``zero_pp_rank_{0,1}_mp_rank_{00,01}_optim_states.pt``): each model-parallel rank's
  partitions cut ``decoder.layers.0.mlp.linear_fc2.weight``'s shard in two.

``python -m tests.layouts.deepspeed_tp_run OUT --pipeline`` builds the pipeline runs
instead (``PIPE_RUNS``), on 4 processes: the same model's layers in a ``PipelineModule``
of 2 stages x 2 tensor-parallel ranks (DeepSpeed's ``PipeModelDataParallelTopology``,
``engine.train_batch``), legacy Megatron's names under each layer's global index
(``1.self_attention.query_key_value.weight``), so that ``save_checkpoint`` writes
``layer_II-model_TT-model_states.pt`` (layer ``II``'s shards of tensor-parallel rank
``TT``) beside ``mp_rank_00`` .. ``mp_rank_03`` (stage x 2 + tensor-parallel rank):

* ``pipe2_zero0/``: without ZeRO, saved at steps 1 and 2;
* ``pipe2_zero1/``: ZeRO 1 (the most DeepSpeed's pipeline engine takes), saved at step 2;
* ``pipe1_dp2_zero0/``: one stage x 2 tensor-parallel ranks x 2 data-parallel ranks (as
  Megatron-DeepSpeed's ``GPTModelPipe`` runs without pipeline parallelism), without ZeRO:
  ``mp_rank_00``, ``mp_rank_01`` beside ``layer_II-model_TT`` files.

Beside each, ``<run>.reference.pt`` holds the tests' references, rank 0's:
``exact``, every parameter's full fp32 master weight, ``exp_avg`` and ``exp_avg_sq``
and Adam's step, as DeepSpeed's own ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state`` give each rank's shard, gathered with
``all_gather`` along the split axis (replicated ones: rank 0's, checked equal on
both); ``mirror``, the same model unsplit, trained alongside with plain
``torch.optim.AdamW`` on the same batches (what tensor parallelism computes, up
to float32 rounding in the reduction order); ``split``, each name's axis (None:
replicated); ``order``, the model's. A pipeline's ``exact`` is every stage's, gathered
from all ranks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from tests.layouts.deepspeed_runs import spawn

TP = 2
VOCAB, HIDDEN, HEADS, FFN, CONTEXT, LAYERS = 32, 8, 2, 16, 6, 2
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.8, 0.95), 1e-6, 0.1
# (folder, ZeRO stage, naming, steps saved)
RUNS = (
    ("zero1_core", 1, "core", (2, 3)),
    ("zero2_legacy", 2, "legacy", (2,)),
    ("zero1_plain", 1, "plain", (2,)),
    ("zero3_core", 3, "core", (2,)),
    ("zero0_core", 0, "core", (2,)),
    ("zero0_bf16", 0, "core", (2,)),  # bf16 mixed precision (the name says so)
)
# On 4 processes: tensor parallelism 2 x data parallelism 2, so that ZeRO cuts each
# model-parallel rank's flat partition inside a parameter's shard.
DP_RUNS = (("zero2_dp2", 2, "core", (2,)),)
# On 4 processes: a PipelineModule of stages x TP tensor-parallel ranks x the rest
# data-parallel ranks, (folder, stages, ZeRO stage, steps saved); DeepSpeed's pipeline engine
# takes ZeRO 1 at most.
PIPE_WORLD = 4
PIPE_RUNS = (
    ("pipe2_zero0", 2, 0, (1, 2)),
    ("pipe2_zero1", 2, 1, (2,)),
    ("pipe1_dp2_zero0", 1, 0, (2,)),  # one stage, two data-parallel ranks
)
# Each naming's module names: embedding, position embedding, the layers' prefix, the
# attention's qkv and proj, the MLP's fc1 and fc2, the two layer norms, the final norm,
# the output layer.
NAMES = {
    "core": (
        "embedding.word_embeddings",
        "embedding.position_embeddings",
        "decoder.layers",
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
        "input_layernorm",
        "pre_mlp_layernorm",
        "decoder.final_layernorm",
        "output_layer",
    ),
    "legacy": (
        "language_model.embedding.word_embeddings",
        "language_model.embedding.position_embeddings",
        "language_model.encoder.layers",
        "self_attention.query_key_value",
        "self_attention.dense",
        "mlp.dense_h_to_4h",
        "mlp.dense_4h_to_h",
        "input_layernorm",
        "post_attention_layernorm",
        "language_model.encoder.final_layernorm",
        "language_model.output_layer",
    ),
    "plain": (
        "wte",
        "wpe",
        "blocks",
        "attn.qkv",
        "attn.proj",
        "ffn.up",
        "ffn.down",
        "ln_1",
        "ln_2",
        "ln_f",
        "head",
    ),
}


class ModelParallelUnit:
    """DeepSpeed's ``mpu`` interface over ``world`` ranks, Megatron's order: tensor-parallel
    groups of ``TP`` consecutive ranks, data-parallel groups of the ranks ``TP`` apart."""

    def __init__(self, dist, world: int):
        rank = dist.get_rank()
        self.tp_rank, self.dp_rank, self.dp = rank % TP, rank // TP, world // TP
        # Every rank creates every group, in the same order (torch.distributed.new_group).
        tp = [dist.new_group(list(range(s, s + TP))) for s in range(0, world, TP)]
        dp = [dist.new_group(list(range(t, world, TP))) for t in range(TP)]
        self.tp_group, self.dp_group = tp[self.dp_rank], dp[self.tp_rank]

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return TP

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return 0

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


def _model(tp: int, rank: int, naming: str, group, pipeline: bool = False):
    """The tiny GPT split ``tp`` ways, this rank's part (``tp == 1``: the whole model); or
    (``pipeline``) its layers as a ``PipelineModule`` takes them: the embeddings, the
    transformer layers, the final norm with the output layer, each a module of its own whose
    children keep the last part of the naming's module names (``word_embeddings``,
    ``self_attention.query_key_value``, ``final_layernorm``...), as Megatron-DeepSpeed's
    ``GPTModelPipe`` names its layers."""
    import torch
    import torch.distributed as dist

    class CopyToRegion(torch.autograd.Function):
        """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad

    class ReduceFromRegion(torch.autograd.Function):
        """Megatron's ``g``: all-reduce forward, identity backward."""

        @staticmethod
        def forward(ctx, x):
            x = x.contiguous()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    class GatherFromRegion(torch.autograd.Function):
        """The output layer's logits: gathered on the last axis, each rank's slice back."""

        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx, grad):
            return grad.chunk(tp, dim=-1)[rank].contiguous()

    def copy_in(x):
        return CopyToRegion.apply(x) if tp > 1 else x

    def reduce_out(x):
        return ReduceFromRegion.apply(x) if tp > 1 else x

    def mark(param, axis):
        # Megatron's attributes: DeepSpeed's gradient norm skips duplicates by them.
        if tp > 1:
            param.tensor_model_parallel = True
            param.partition_dim = axis
            param.partition_stride = 1

    class Column(torch.nn.Module):
        def __init__(self, out_features, in_features, bias=True):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(out_features // tp, in_features))
            mark(self.weight, 0)
            self.bias = torch.nn.Parameter(torch.zeros(out_features // tp)) if bias else None
            if bias:
                mark(self.bias, 0)

        def forward(self, x):
            return torch.nn.functional.linear(copy_in(x), self.weight, self.bias)

    class Row(torch.nn.Module):
        def __init__(self, out_features, in_features):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(out_features, in_features // tp))
            mark(self.weight, 1)
            self.bias = torch.nn.Parameter(torch.zeros(out_features))  # replicated

        def forward(self, x):
            return reduce_out(torch.nn.functional.linear(x, self.weight)) + self.bias

    class Nest(torch.nn.Module):
        """A module holding ``child`` under a dotted ``path`` (``mlp.linear_fc1``)."""

    def put(root, path, child):
        *parents, last = path.split(".")
        for part in parents:
            if not hasattr(root, part):
                root.add_module(part, Nest())
            root = getattr(root, part)
        root.add_module(last, child)

    def get(root, path):
        for part in path.split("."):
            root = getattr(root, part)
        return root

    (emb, pos, layers, qkv, proj, fc1, fc2, ln1, ln2, lnf, out) = NAMES[naming]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            put(self, ln1, torch.nn.LayerNorm(HIDDEN))
            put(self, qkv, Column(3 * HIDDEN, HIDDEN))
            put(self, proj, Row(HIDDEN, HIDDEN))
            put(self, ln2, torch.nn.LayerNorm(HIDDEN))
            put(self, fc1, Column(FFN, HIDDEN))
            put(self, fc2, Row(HIDDEN, FFN))

        def forward(self, x):
            b, t, _ = x.shape
            heads = HEADS // tp
            # Megatron's qkv layout: per head, its q, k and v rows together, so that the
            # ranks' rows side by side are the whole layer's.
            q, k, v = get(self, qkv)(get(self, ln1)(x)).view(b, t, heads, 3, -1).unbind(3)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + get(self, proj)(a.transpose(1, 2).reshape(b, t, -1))
            h = torch.nn.functional.gelu(get(self, fc1)(get(self, ln2)(x)))
            return x + get(self, fc2)(h)

    def embedded(root, ids, emb=emb, pos=pos):
        # The vocabulary-parallel embedding: each rank looks up its rows, zero elsewhere.
        part = VOCAB // tp
        local = ids - rank * part
        inside = (local >= 0) & (local < part)
        x = get(root, emb)(local.clamp(0, part - 1)) * inside.unsqueeze(-1)
        return reduce_out(x) + get(root, pos)(torch.arange(ids.shape[1]))

    def logits(root, x, lnf=lnf, out=out):
        logits = get(root, out)(get(root, lnf)(x))
        return GatherFromRegion.apply(logits) if tp > 1 else logits

    def embeddings(root, emb=emb, pos=pos):
        put(root, emb, torch.nn.Embedding(VOCAB // tp, HIDDEN))
        mark(get(root, emb).weight, 0)
        put(root, pos, torch.nn.Embedding(CONTEXT, HIDDEN))

    def head(root, lnf=lnf, out=out):
        put(root, lnf, torch.nn.LayerNorm(HIDDEN))
        put(root, out, Column(VOCAB, HIDDEN, bias=False))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            embeddings(self)
            stack = torch.nn.ModuleList([Layer() for _ in range(LAYERS)])
            put(self, layers, stack)
            head(self)

        def forward(self, ids):
            x = embedded(self, ids)
            for layer in get(self, layers):
                x = layer(x)
            return logits(self, x)

    def last(path):
        return path.rpartition(".")[2]

    class Embeddings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            embeddings(self, last(emb), last(pos))

        def forward(self, ids):
            return embedded(self, ids, last(emb), last(pos))

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            head(self, last(lnf), last(out))

        def forward(self, x):
            return logits(self, x, last(lnf), last(out))

    if pipeline:
        return [Embeddings(), *(Layer() for _ in range(LAYERS)), Head()]
    return GPT()


def _axis(name: str, naming: str) -> int | None:
    """The axis ``name`` is split along (None: replicated), by the model's construction."""
    (emb, _, _, qkv, proj, fc1, fc2, *_, out) = NAMES[naming]
    module, _, kind = name.rpartition(".")
    # The whole model's module names, or a pipeline layer's (``0.word_embeddings``).
    if module.endswith((qkv, fc1)) or module.rpartition(".")[2] in (
        emb.rpartition(".")[2],
        out.rpartition(".")[2],
    ):
        return 0
    if module.endswith((proj, fc2)):
        return 1 if kind == "weight" else None
    return None


def _start(rank: int, port: int, world: int) -> None:
    """This process as rank ``rank`` of ``world``: gloo alone, as in deepspeed_runs.py (no
    JIT-compiled shared-memory collective)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
    )
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def _initialised(mirror) -> None:
    """The unsplit model's parameters drawn away from LayerNorm's ones and zeros, so that
    every tensor has a norm of its own."""
    import torch

    with torch.no_grad():
        for name, p in mirror.named_parameters():
            torch.nn.init.normal_(
                p,
                mean=1.0 if p.dim() == 1 and name.endswith("weight") else 0.0,
                std=0.3 if p.dim() == 2 else 0.1,
            )


def _sharded(model, mirror, naming: str, tp_rank: int) -> dict[str, int | None]:
    """``model``'s parameters set to this rank's shards of ``mirror``'s; each name's axis."""
    import torch

    full = dict(mirror.named_parameters())
    split = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            axis = split[name] = _axis(name, naming)
            whole = full[name]
            p.copy_(whole if axis is None else whole.chunk(TP, dim=axis)[tp_rank])
    return split


def _groups(module) -> list[dict]:
    """Two param groups: the decayed matrices, and the rest without weight decay."""
    named = list(module.named_parameters())
    decayed = [p for n, p in named if n.endswith("weight") and p.dim() == 2]
    ids = {id(p) for p in decayed}
    return [
        {"params": decayed},
        {"params": [p for _, p in named if id(p) not in ids], "weight_decay": 0.0},
    ]


def _config(stage: int, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
                "torch_adam": True,
            },
        },
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }


def _loss(logits, target):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _exact(engine, base, stage: int, bf16: bool, split: dict, tp_group) -> dict[str, dict]:
    """Every parameter this rank holds, whole: its fp32 master weight, ``exp_avg`` and
    ``exp_avg_sq`` as DeepSpeed holds them (the engine's parameters and ``base``'s state
    without ZeRO, ``safe_get_full_*`` under ZeRO), gathered from the tensor-parallel ranks
    along ``split``'s axis (replicated ones checked equal), and Adam's step."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed links each parameter to its optimizer state once, after the first
    # param group's first step (stage_1_and_2.py ``_optimizer_step``), when the
    # second group has no state yet: linked again now that every group has one.
    # (ZeRO 3 finds the state at each call.)
    if 1 <= stage <= 2:
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    exact = {}
    masters = {}
    if stage == 0 and bf16:  # FP16_UnfusedOptimizer: a master beside each parameter
        for low, high in zip(engine.optimizer.fp16_groups, engine.optimizer.fp32_groups):
            masters.update({id(q): m for q, m in zip(low, high)})
    for name, p in engine.module.named_parameters():
        if stage == 0:  # AdamW steps the parameters, or their fp32 masters under bf16
            main = masters[id(p)] if bf16 else p
            entry = {
                "weight": main.detach().clone(),
                **{k: base.state[main][k].clone() for k in ("exp_avg", "exp_avg_sq")},
            }
        else:
            entry = {
                "weight": safe_get_full_fp32_param(p),
                **{k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")},
            }
        axis = split[name]
        for key, value in entry.items():
            parts = [torch.empty_like(value) for _ in range(TP)]
            dist.all_gather(parts, value.contiguous(), group=tp_group)
            if axis is None:
                assert all(torch.equal(parts[0], q) for q in parts), (name, key)
                entry[key] = parts[0]
            else:
                entry[key] = torch.cat(parts, dim=axis)
        entry["step"] = float(next(iter(base.state.values()))["step"])
        exact[name] = entry
    return exact


def _save_reference(out, folder_name, step, exact, mirror, plain, split, named) -> None:
    """Rank 0 writes ``<folder_name>.step<step>.reference.pt``: the engine's own values
    (``exact``), the plain mirror's, the split of each parameter, and ``named``'s parameter
    order."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        reference = {"exact": exact, "mirror": _mirrored(mirror, plain), "split": split,
                     "order": [n for n, _ in named.named_parameters()]}
        torch.save(reference, os.path.join(out, f"{folder_name}.step{step}.reference.pt"))


def _mirrored(mirror, plain) -> dict[str, dict]:
    """The unsplit run's weights and AdamW state, by name."""
    return {
        name: {"weight": p.detach().clone(), **{k: v.clone() for k, v in plain.state[p].items()}}
        for name, p in mirror.named_parameters()
    }


def _worker(rank: int, port: int, out: str, world: int, runs: tuple) -> None:
    _start(rank, port, world)
    import deepspeed
    import torch
    import torch.distributed as dist

    mpu = ModelParallelUnit(dist, world)
    tp_rank = mpu.tp_rank
    for folder_name, stage, naming, saves in runs:
        bf16 = folder_name.endswith("_bf16")
        torch.manual_seed(0)
        mirror = _model(1, 0, naming, None)
        _initialised(mirror)
        model = _model(TP, tp_rank, naming, mpu.tp_group)
        split = _sharded(model, mirror, naming, tp_rank)
        plain = torch.optim.AdamW(
            _groups(mirror), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=_groups(model), config=_config(stage, bf16), mpu=mpu
        )
        # Without ZeRO in fp32 the engine steps torch's AdamW itself; else it wraps it.
        base = engine.optimizer if stage == 0 and not bf16 else engine.optimizer.optimizer
        assert type(base).__name__ == "AdamW"
        # Each data-parallel rank its own batches, the same on its tensor-parallel ranks.
        g = torch.Generator().manual_seed(stage + 100 * mpu.dp_rank)
        for step in range(1, max(saves) + 1):
            ids = torch.randint(0, VOCAB, (3, CONTEXT), generator=g)
            target = torch.randint(0, VOCAB, (3, CONTEXT), generator=g)
            engine.backward(_loss(engine(ids), target))
            engine.step()
            plain.zero_grad()
            _loss(mirror(ids), target).backward()
            if mpu.dp > 1:  # what data parallelism computes: the ranks' gradients averaged
                for p in mirror.parameters():
                    dist.all_reduce(p.grad, group=mpu.dp_group)
                    p.grad /= mpu.dp
            plain.step()
            if step not in saves:
                continue
            client = {}
            if naming == "legacy":  # as Megatron-DeepSpeed's save_checkpoint passes it
                client = {
                    "args": argparse.Namespace(
                        hidden_size=HIDDEN,
                        num_attention_heads=HEADS,
                        num_layers=LAYERS,
                        ffn_hidden_size=FFN,
                        tensor_model_parallel_size=TP,
                        pipeline_model_parallel_size=1,
                        iteration=step,
                    ),
                    "iteration": step,
                }
            engine.save_checkpoint(os.path.join(out, folder_name), client_state=client)
            exact = _exact(engine, base, stage, bf16, split, mpu.tp_group)  # every rank's part
            _save_reference(out, folder_name, step, exact, mirror, plain, split, model)
        engine.destroy()
    dist.barrier()


def _pipeline_worker(rank: int, port: int, out: str, runs: tuple) -> None:
    """``PIPE_RUNS``: the tiny GPT's layers (``_model(pipeline=True)``, legacy Megatron's
    names) in a ``PipelineModule`` over DeepSpeed's own topology
    (``PipeModelDataParallelTopology``: rank = (stage x data-parallel ranks +
    data-parallel rank) x TP + tensor-parallel rank)."""
    _start(rank, port, PIPE_WORLD)
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    def own_group(ranks_lists):
        # Every rank makes every group, in the same order (torch.distributed.new_group).
        groups = [dist.new_group(ranks) for ranks in ranks_lists]
        return next(g for g, ranks in zip(groups, ranks_lists) if rank in ranks)

    for folder_name, stages, stage, saves in runs:
        dp = PIPE_WORLD // (stages * TP)
        topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=TP, num_dp=dp)
        coord = topology.get_coord(rank)
        # The layers' own groups, made before the module's.
        tp_group = own_group(topology.get_axis_comm_lists("model"))
        dp_group = own_group(topology.get_axis_comm_lists("data"))
        torch.manual_seed(0)
        mirror = torch.nn.Sequential(*_model(1, 0, "legacy", None, pipeline=True))
        _initialised(mirror)
        layers = _model(TP, coord.model, "legacy", tp_group, pipeline=True)
        split = _sharded(torch.nn.Sequential(*layers), mirror, "legacy", coord.model)
        plain = torch.optim.AdamW(
            _groups(mirror), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )
        net = PipelineModule(
            layers=layers, topology=topology, loss_fn=_loss, partition_method="uniform"
        )
        engine, *_ = deepspeed.initialize(
            model=net, model_parameters=_groups(net), config=_config(stage)
        )
        base = engine.optimizer if stage == 0 else engine.optimizer.optimizer
        assert type(base).__name__ == "AdamW"
        # Each data-parallel rank its own batches, the same on its stages' ranks.
        g = torch.Generator().manual_seed(stage + 100 * coord.data)
        for step in range(1, max(saves) + 1):
            ids = torch.randint(0, VOCAB, (3, CONTEXT), generator=g)
            target = torch.randint(0, VOCAB, (3, CONTEXT), generator=g)
            engine.train_batch(data_iter=iter([(ids, target)]))
            plain.zero_grad()
            _loss(mirror(ids), target).backward()
            if dp > 1:  # what data parallelism computes: the ranks' gradients averaged
                for p in mirror.parameters():
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= dp
            plain.step()
            if step not in saves:
                continue
            engine.save_checkpoint(os.path.join(out, folder_name))
            own = _exact(engine, base, stage, False, split, tp_group)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own)
            exact = {}
            for held in gathered:  # each stage's parameters (its other ranks' alike)
                exact.update(held)
            _save_reference(out, folder_name, step, exact, mirror, plain, split, mirror)
        engine.destroy()
    dist.barrier()


def build(out: Path, pipeline: bool = False) -> None:
    if pipeline:
        spawn(_pipeline_worker, out, PIPE_RUNS, nprocs=PIPE_WORLD)
        return
    spawn(_worker, out, TP, RUNS)
    spawn(_worker, out, 2 * TP, DP_RUNS, nprocs=2 * TP)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    build(Path(sys.argv[1]), pipeline="--pipeline" in sys.argv[2:])
