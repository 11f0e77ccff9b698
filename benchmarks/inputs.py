"""Seeded inputs: gradients in memory, and checkpoint files written without holding them.

Shapes follow real models so that tensor sizes (and so kernel behaviour) are
realistic: GPT-2 124M (148 tensors) and a Llama-style 3B model (254 tensors,
largest 394M elements). Values are normal, scaled per tensor by a seeded
factor in [1e-4, 1e-2], as gradients of a trained network roughly are.

Files are written in ``torch.save``'s zip format without ever materialising
the tensors: ``torch.serialization.skip_data`` writes the archive with holes
where the bytes go, then each tensor's bytes are ``pwrite``-n into its record
in 16 MiB chunks copied from a seeded random pool. A 6 GB checkpoint thus costs
one chunk of memory, and a few seconds more than the disk needs.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "_data"

_POOL = 1 << 22  # elements in the random pool a file's chunks are copied from


def gpt2_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2 124M: 148 tensors, 124,439,808 elements."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (ctx, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]  # fmt: skip
    return shapes + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def llama_3b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Llama 3.2 3B layout: 28 layers, d=3072, GQA with 8 KV heads, tied embeddings.

    254 tensors, 3.21e9 elements (6.4 GB in bf16); the largest is the
    128256 x 3072 embedding (394M elements, 788 MB in bf16).
    """
    d, ffn, kv, vocab, layers = 3072, 8192, 1024, 128256, 28
    shapes = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        h = f"model.layers.{i}."
        shapes += [
            (h + "self_attn.q_proj.weight", (d, d)), (h + "self_attn.k_proj.weight", (kv, d)),
            (h + "self_attn.v_proj.weight", (kv, d)), (h + "self_attn.o_proj.weight", (d, d)),
            (h + "mlp.gate_proj.weight", (ffn, d)), (h + "mlp.up_proj.weight", (ffn, d)),
            (h + "mlp.down_proj.weight", (d, ffn)),
            (h + "input_layernorm.weight", (d,)), (h + "post_attention_layernorm.weight", (d,)),
        ]  # fmt: skip
    return shapes + [("model.norm.weight", (d,))]


def llama2_7b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Llama-2-7B: 32 layers, d=4096, ffn 11008, untied 32000-token embedding and head.

    291 tensors, 6.74e9 elements (13.5 GB in bf16).
    """
    d, ffn, vocab, layers = 4096, 11008, 32000, 32
    shapes = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        h = f"model.layers.{i}."
        shapes += [
            (h + "self_attn.q_proj.weight", (d, d)), (h + "self_attn.k_proj.weight", (d, d)),
            (h + "self_attn.v_proj.weight", (d, d)), (h + "self_attn.o_proj.weight", (d, d)),
            (h + "mlp.gate_proj.weight", (ffn, d)), (h + "mlp.up_proj.weight", (ffn, d)),
            (h + "mlp.down_proj.weight", (d, ffn)),
            (h + "input_layernorm.weight", (d,)), (h + "post_attention_layernorm.weight", (d,)),
        ]  # fmt: skip
    return shapes + [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]


def small_shapes(count: int = 20_000, size: int = 1024) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"p{i}", (size,)) for i in range(count)]


def uniform_shapes(count: int, size: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` equal 1-D tensors: for scaling in bytes or in tensor count alone."""
    return [(f"layer{i}.weight", (size,)) for i in range(count)]


def numel(shapes) -> int:
    total = 0
    for _, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def _scales(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.pow(10.0, torch.empty(count, dtype=torch.float64).uniform_(-4, -2, generator=g))


def gradients(shapes, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Normal values, one seeded scale per tensor, generated in float32 then cast."""
    g = torch.Generator().manual_seed(seed)
    scales = _scales(len(shapes), seed).tolist()
    out = []
    for (_, shape), scale in zip(shapes, scales):
        t = torch.randn(shape, generator=g).mul_(scale)
        out.append(t if dtype == torch.float32 else t.to(dtype))
    return out


def checkpoint_file(name: str, shapes, dtype: torch.dtype, seed: int = 0) -> Path:
    """``_data/<name>.pt`` holding ``{"grads": {name: tensor}, "step": 1}``; reused if present.

    A small JSON manifest beside the file records what was asked for, so a
    changed request rebuilds the file instead of silently reusing it.
    """
    DATA.mkdir(exist_ok=True)
    path = DATA / f"{name}.pt"
    manifest = path.with_suffix(".json")
    want = {"shapes": [[n, list(s)] for n, s in shapes], "dtype": str(dtype), "seed": seed}
    if path.exists() and manifest.exists() and json.loads(manifest.read_text()) == want:
        return path
    manifest.unlink(missing_ok=True)
    _write_torch_zip(path, shapes, dtype, seed)
    manifest.write_text(json.dumps(want))
    return path


def _write_torch_zip(path: Path, shapes, dtype: torch.dtype, seed: int) -> None:
    # torch.empty reserves address space only; skip_data never reads it.
    placeholders = {n: torch.empty(s, dtype=dtype) for n, s in shapes}
    with open(path, "wb") as f, torch.serialization.skip_data():
        torch.save({"grads": placeholders, "step": 1}, f)
    del placeholders
    # torch.save numbers storages in pickling order: tensor i is record data/i.
    reader = torch._C.PyTorchFileReader(str(path))
    offsets = [reader.get_record_offset(f"data/{i}") for i in range(len(shapes))]
    del reader

    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * _POOL, generator=g)
    scales = _scales(len(shapes), seed).tolist()
    chunk = torch.empty(_POOL, dtype=dtype)
    wide = torch.empty(_POOL)
    fd = os.open(path, os.O_WRONLY)
    try:
        for i, ((_, shape), scale, offset) in enumerate(zip(shapes, scales, offsets)):
            n = numel([(None, shape)])
            for s in range(0, n, _POOL):
                k = min(_POOL, n - s)
                start = (i * 7919 + s // _POOL * 104729) % _POOL
                out = chunk[:k]
                torch.mul(pool[start : start + k], scale, out=wide[:k])
                out.copy_(wide[:k])
                size = k * out.element_size()
                buf = (ctypes.c_char * size).from_address(out.data_ptr())
                written = os.pwrite(fd, buf, offset + s * out.element_size())
                assert written == size, (written, size)
        # Flushed now, so write-back does not run under a later measurement.
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_big_files(min_bytes: int = 1 << 30) -> list[Path]:
    """Delete generated files of at least ``min_bytes`` (and their manifests)."""
    removed = []
    for path in DATA.glob("*.pt"):
        if path.stat().st_size >= min_bytes:
            path.unlink()
            path.with_suffix(".json").unlink(missing_ok=True)
            removed.append(path)
    return removed
