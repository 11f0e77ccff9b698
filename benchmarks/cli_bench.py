"""Issue 3, targets 4, 5 and 7: ``gradclip inspect`` and ``clip`` end to end, as processes.

Every contender is a fresh process, so Python and torch start-up count for
all of them alike. The page cache is warm: the warm-up repetition reads every
file before any time is kept.

* floor: a process that imports torch and reads every byte of the file once,
  the least any tool that looks at every gradient can cost;
* plain torch: the script a user would write, ``torch.load(mmap=True,
  weights_only=True)`` then ``torch.nn.utils.get_total_norm`` (and for clip,
  ``_foreach_mul_`` by the clip coefficient and ``torch.save``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import inputs
from .report import Section, Target, ratio
from .timing import fmt_bytes, fmt_seconds, interleaved, markdown_table, run_process

PYTHON = sys.executable
GRADCLIP = str(Path(sys.executable).with_name("gradclip"))

FLOOR = """
import sys, torch
buf = bytearray(16 << 20)
with open(sys.argv[1], "rb", buffering=0) as f:
    while f.readinto(buf):
        pass
"""

PLAIN_INSPECT = """
import sys, torch
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
print(float(torch.nn.utils.get_total_norm(list(sd["grads"].values()))))
"""

# fsync=1 adds what gradclip's atomic write does: flush to disk, then rename.
PLAIN_CLIP = """
import os, sys, torch
path, out, max_norm, fsync = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
sd = torch.load(path, mmap=True, weights_only=True)
grads = list(sd["grads"].values())
total = torch.nn.utils.get_total_norm(grads)
torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
if fsync:
    with open(out + ".tmp", "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(out + ".tmp", out)
else:
    torch.save(sd, out)
"""


def inspect_contenders(path: Path) -> dict:
    p = str(path)
    return {
        "floor (import torch, read file)": lambda: run_process([PYTHON, "-c", FLOOR, p]),
        "plain torch script": lambda: run_process([PYTHON, "-c", PLAIN_INSPECT, p]),
        "gradclip inspect --format json":
            lambda: run_process([GRADCLIP, "inspect", p, "--format", "json", "-q"]),
    }  # fmt: skip


def inspect_table(results: dict, nbytes: int) -> str:
    floor = results["floor (import torch, read file)"].median
    plain = results["plain torch script"].median
    rows = [
        [name, fmt_seconds(r.median), f"{nbytes / r.median / 1e9:.2f}",
         ratio(r.median, floor), ratio(r.median, plain), fmt_bytes(r.max_rss)]
        for name, r in results.items()
    ]  # fmt: skip
    return markdown_table(
        ["contender", "median", "GB/s", "time / floor", "time / plain torch", "peak RSS"], rows
    )


def _inspect_section(label: str, path: Path, repeats: int, warmup: int):
    nbytes = path.stat().st_size
    results = interleaved(inspect_contenders(path), repeats, warmup)
    text = f"{label}: `{path.name}`, {nbytes / 1e6:.0f} MB.\n\n{inspect_table(results, nbytes)}\n"
    ours = results["gradclip inspect --format json"].median
    return results, text, ours


def run(quick: bool, repeats: int) -> Section:
    gpt2 = inputs.checkpoint_file("gpt2_fp32", inputs.gpt2_shapes(), torch.float32)
    small = inputs.checkpoint_file("small_20k_fp32", inputs.small_shapes(), torch.float32)
    parts, targets = [], []
    # Quick runs skip the warm-up: the files were just written, so already cached.
    warmup = 0 if quick else 1

    res, text, ours = _inspect_section("4. inspect, GPT-2 124M float32", gpt2, repeats, warmup)
    parts.append(text)
    floor_ratio = ours / res["floor (import torch, read file)"].median
    plain_ratio = ours / res["plain torch script"].median
    targets.append(Target("4a. inspect GPT-2 fp32 vs floor", f"{floor_ratio:.2f}x", "<= 1.15x",
                          floor_ratio <= 1.15))
    targets.append(Target("4b. inspect GPT-2 fp32 vs plain torch", f"{plain_ratio:.2f}x",
                          "< 1x (faster)", plain_ratio < 1.0))

    res, text, ours = _inspect_section("5. inspect, 20,000 x 1,024 float32", small, repeats,
                                       warmup)
    parts.append(text)
    plain_ratio = ours / res["plain torch script"].median
    targets.append(Target("5. inspect 20k tensors vs plain torch", f"{plain_ratio:.2f}x",
                          "<= 0.8x", plain_ratio <= 0.8))

    out = inputs.DATA / "clip_out.pt"
    # The GPT-2 gradients' total norm is about 0.5: 0.01 clips every tensor.
    g, o = str(gpt2), str(out)
    contenders = {
        "plain torch script (torch.save)":
            lambda: run_process([PYTHON, "-c", PLAIN_CLIP, g, o, "0.01", "0"]),
        "plain torch script (+ fsync, rename)":
            lambda: run_process([PYTHON, "-c", PLAIN_CLIP, g, o, "0.01", "1"]),
        "gradclip clip --max-norm 0.01":
            lambda: run_process([GRADCLIP, "clip", g, "--max-norm", "0.01", "-o", o,
                                 "--format", "json", "-q"]),
    }  # fmt: skip
    results = interleaved(contenders, repeats, warmup)
    out.unlink(missing_ok=True)
    plain = results["plain torch script (torch.save)"].median
    rows = [[name, fmt_seconds(r.median), ratio(r.median, plain), fmt_bytes(r.max_rss)]
            for name, r in results.items()]
    parts.append("7. clip, GPT-2 124M float32 (output written to the same disk):\n\n"
                 + markdown_table(["contender", "median", "time / plain torch", "peak RSS"], rows)
                 + "\n")
    r = results["gradclip clip --max-norm 0.01"].median / plain
    targets.append(Target("7. clip GPT-2 fp32 vs plain torch (torch.save)", f"{r:.2f}x",
                          "<= 1.2x", r <= 1.2))
    r2 = results["gradclip clip --max-norm 0.01"].median / results[
        "plain torch script (+ fsync, rename)"].median
    targets.append(Target("7'. clip vs plain torch doing the same fsync + rename", f"{r2:.2f}x",
                          "context", None))
    body = ("Each contender is a fresh process; medians of the timed repetitions, "
            "contenders interleaved. Ratios are time / baseline time: below 1 is faster.\n\n"
            + "\n".join(parts))
    return Section("End to end: inspect and clip (targets 4, 5, 7)", body, targets)
