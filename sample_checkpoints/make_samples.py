"""Build the sample gradient checkpoints in this folder, deterministically.

A tiny GPT-2-shaped model (real parameter names, tied token embedding and
language-model head) runs one real forward and backward pass and one AdamW
step on fixed random tokens; its gradients are saved in every layout gradclip
reads. See README.md here for what each file shows.

    python sample_checkpoints/make_samples.py            # rewrite this folder
    python sample_checkpoints/make_samples.py --out DIR  # write elsewhere

Reproducible on one machine, and across machines up to float rounding: the
model is initialised from uniform bits (CPU ``randn`` takes a different code
path per SIMD level), and the passes run in float64 and are rounded once to
float32, so most last-bit differences between BLAS kernels on different CPUs
vanish in the rounding. Values whose exact result is zero keep float64 noise
(near 1e-18) that differs by CPU. tests/test_samples.py regenerates the files
and compares every tensor with the committed ones within that bound.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradclip_cli.producer import save_grads

CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 64,
    "n_positions": 8,
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 2,
    "tie_word_embeddings": True,
    "batch_size": 4,
    "seq_len": 8,
    "optimizer": "AdamW",
    "lr": 1e-3,
    "betas": [0.9, 0.999],
    "weight_decay": 0.1,
    "seed": 0,
}
STEP = 100  # the step number stored in the gradient dumps
EXPLODING_PREFIX = "transformer.h.1."
EXPLODING_SCALE = 1e4
NAN_TENSOR = "transformer.h.0.mlp.c_fc.weight"
INF_TENSOR = "transformer.h.1.attn.c_proj.weight"
SAFETENSORS_METADATA = {"step": str(STEP), "producer": "sample_checkpoints/make_samples.py"}


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT-2's module tree in miniature, so parameter names match real checkpoints."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        n_embd = cfg["n_embd"]
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg["vocab_size"], n_embd),
                "wpe": nn.Embedding(cfg["n_positions"], n_embd),
                "h": nn.ModuleList(Block(n_embd, cfg["n_head"]) for _ in range(cfg["n_layer"])),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build_model(generator: torch.Generator) -> TinyGPT:
    """A float64 TinyGPT with every parameter drawn uniformly from a fixed generator."""
    model = TinyGPT(CONFIG).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.02, 0.02, generator=generator)
            elif p.dim() == 1:  # LayerNorm scale: near 1, not exactly, so its grad is not trivial
                p.uniform_(0.9, 1.1, generator=generator)
            else:
                # Variance 1/fan_in: unit-variance inputs give unit-variance outputs.
                bound = math.sqrt(3.0 / p.size(-1))
                p.uniform_(-bound, bound, generator=generator)
    return model


def train_one_step() -> tuple[TinyGPT, torch.optim.AdamW]:
    """One real forward/backward pass and AdamW step; returns float32 model and optimizer.

    The returned model holds the post-step weights and the step's gradients,
    each rounded once from float64 to float32.
    """
    generator = torch.Generator().manual_seed(CONFIG["seed"])
    model = build_model(generator)
    tokens = torch.randint(
        CONFIG["vocab_size"], (CONFIG["batch_size"], CONFIG["seq_len"] + 1), generator=generator
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    hyperparameters = {
        "lr": CONFIG["lr"],
        "betas": tuple(CONFIG["betas"]),
        "weight_decay": CONFIG["weight_decay"],
        "foreach": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), **hyperparameters)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, CONFIG["vocab_size"]), targets.reshape(-1))
    loss.backward()
    optimizer.step()

    # Module.float() converts each parameter and its .grad in place, so the
    # tie survives; a new optimizer's load_state_dict then casts the moment
    # estimates to the parameters' new dtype.
    model.float()
    optimizer32 = torch.optim.AdamW(model.parameters(), **hyperparameters)
    optimizer32.load_state_dict(optimizer.state_dict())
    return model, optimizer32


def write_samples(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, optimizer = train_one_step()
    params = dict(model.named_parameters())
    healthy = {name: p.grad.clone() for name, p in params.items()}

    save_grads(model, out / "healthy.pt", step=STEP)
    save_grads(model, out / "healthy.safetensors", **SAFETENSORS_METADATA)
    save_grads(
        model,
        out / "training_state.pt",
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        step=1,
        config=CONFIG,
    )
    # Written directly: this is the pre-1.6 pickle layout (no zip), flat name -> tensor.
    torch.save(healthy, out / "flat_legacy.pt", _use_new_zipfile_serialization=False)

    with torch.no_grad():
        for name, p in params.items():
            if name.startswith(EXPLODING_PREFIX):
                p.grad.mul_(EXPLODING_SCALE)
    save_grads(model, out / "exploding.pt", step=STEP)

    with torch.no_grad():
        for name, p in params.items():
            p.grad.copy_(healthy[name])
        nan_grad = params[NAN_TENSOR].grad.view(-1)
        nan_grad[[3, 17, 42]] = float("nan")
        inf_grad = params[INF_TENSOR].grad.view(-1)
        inf_grad[5] = float("inf")
        inf_grad[11] = float("-inf")
    save_grads(model, out / "nonfinite.pt", step=STEP)

    with torch.no_grad():
        for name, p in params.items():
            p.grad.copy_(healthy[name])
    model.to(torch.bfloat16)  # converts the gradients too
    save_grads(model, out / "bf16.pt", step=STEP)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent, help="folder to write into"
    )
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    write_samples(args.out)


if __name__ == "__main__":
    main()
