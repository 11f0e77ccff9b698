"""Measure how closely ``inspect --previous`` reconstructs the gradients of real runs.

For each torch.optim setting and state dtype, trains the small model of
``tests/previous_runs.py`` for 6 steps over 5 seeds, reconstructs the
gradients of steps 1 and 6 from the checkpoints before and after each
(``gradclip_cli.source.previous.gradients_between``), and compares them with
the gradients the step used (saved with ``save_grads``) in float64. Prints,
per setting, the largest over tensors of

* ``norm_rel``: |norm(g) - norm(g_true)| / norm(g_true), the per-layer norm error;
* ``diff_rel``: norm(g - g_true) / norm(g_true), the elementwise error;
* ``check_units``: the cross-check's largest residual, in units of the state's
  rounding (the bound enforced is ``CHECK_BOUND``).

Run from the repository root: ``python benchmarks/previous_bounds.py [float32|bfloat16]``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradclip_cli.source.layouts import open_checkpoint  # noqa: E402
from gradclip_cli.source.previous import CHECK_BOUND, gradients_between  # noqa: E402
from tests.previous_runs import train  # noqa: E402

optim = torch.optim
CASES = {
    "Adam": lambda m: optim.Adam(m.parameters(), lr=1e-2),
    "Adam L2": lambda m: optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1),
    "AdamW": lambda m: optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "Adam amsgrad L2": lambda m: optim.Adam(m.parameters(), lr=1e-2, amsgrad=True,
                                            weight_decay=0.05),
    "AdamW maximize": lambda m: optim.AdamW(m.parameters(), lr=1e-2, maximize=True),
    "Adam maximize L2": lambda m: optim.Adam(m.parameters(), lr=1e-2, maximize=True,
                                             weight_decay=0.1),
    "Adam foreach L2": lambda m: optim.Adam(m.parameters(), lr=1e-2, foreach=True,
                                            weight_decay=0.1),
    "Adam fused": lambda m: optim.Adam(m.parameters(), lr=1e-2, fused=True),
    "NAdam L2": lambda m: optim.NAdam(m.parameters(), lr=1e-2, weight_decay=0.1),
    "RAdam decoupled": lambda m: optim.RAdam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                             decoupled_weight_decay=True),
    "Adamax L2": lambda m: optim.Adamax(m.parameters(), lr=1e-2, weight_decay=0.1),
    "RMSprop centered": lambda m: optim.RMSprop(m.parameters(), lr=1e-2, centered=True,
                                                momentum=0.9, weight_decay=0.1),
}


def _open(path):
    return open_checkpoint(path, key=None, trust_pickle=False, verify=False)


def _norm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()


def main() -> None:
    names = sys.argv[1:] or ["float32", "bfloat16"]
    print(f"{'setting':18s} {'state':9s} {'norm_rel':>9s} {'diff_rel':>9s} {'check_units':>11s}"
          f"  (bound {CHECK_BOUND:g} units)")
    for dtype in (getattr(torch, n) for n in names):
        for name, make in CASES.items():
            norm_rel = diff_rel = units = 0.0
            for seed in range(5):
                with tempfile.TemporaryDirectory() as folder:
                    run = train(Path(folder), make, steps=6, dtype=dtype, seed=seed)
                    for t in (1, 6):
                        got = gradients_between(_open(run.checkpoint(t)),
                                                _open(run.checkpoint(t - 1)))
                        if got.refusal:
                            raise SystemExit(f"{name}: {got.refusal}")
                        true = run.grads(t)
                        for n, g in got.gradients.items():
                            ref = true[n].double()
                            norm_rel = max(norm_rel, abs(_norm(g) - _norm(ref)) / _norm(ref))
                            diff_rel = max(diff_rel, _norm(g - ref) / _norm(ref))
                        units = max(units, got.disagreement.max_units)
            print(f"{name:18s} {str(dtype).removeprefix('torch.'):9s} {norm_rel:9.2e} "
                  f"{diff_rel:9.2e} {units:11.2f}")


if __name__ == "__main__":
    main()
