"""Reading a ``torch.optim.Optimizer.state_dict()`` as stored, into ``OptimizerState``.

``{"state": {id: {"step": ..., "exp_avg": ..., ...}}, "param_groups": [{"params":
[ids], "lr": ..., ...}]}``; torch >= 2.6 adds ``"param_names"`` to each group
when the optimizer was given named parameters. Everything is checked for
shape before use: the file is data, and a group whose ``params`` is not a
list of ids must be a clear error, not a crash later.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import OptimizerState, StoredTensor
from gradclip_cli.source.untrusted import is_int


def is_optimizer_state(value: Any) -> bool:
    return (isinstance(value, Mapping) and isinstance(value.get("state"), Mapping)
            and isinstance(value.get("param_groups"), (list, tuple)))


# Beside a wrapped optimizer's state dict, the fp32 master weights of mixed precision
# (DeepSpeed's FP16_Optimizer, its unfused and bf16 kin, ZeRO's partitions).
MASTER_WEIGHT_KEYS = ("fp32_groups", "fp32_groups_flat", "single_partition_of_fp32_groups",
                      "fp32_flat_groups")


def wraps_optimizer_state(value: Any) -> bool:
    """A mixed-precision optimizer wrapper's state: torch's state dict under
    ``optimizer_state_dict`` and fp32 master weights beside it. Its tensors are moments
    and weights, never gradients."""
    return (isinstance(value, Mapping) and is_optimizer_state(value.get("optimizer_state_dict"))
            and any(k in value for k in MASTER_WEIGHT_KEYS))


def optimizer_state(value: Any, file: Path, where: str, key: str | None = None
                    ) -> OptimizerState:
    """``value`` (a state dict found at ``where`` in ``file``; ``key``: the ``--key`` that
    names it alone) as ``OptimizerState``."""

    def bad(why: str) -> InputError:
        return InputError(f"{file}: {where} is not an optimizer state dict: {why}")

    if not is_optimizer_state(value):
        raise bad("it needs 'state' and 'param_groups'")
    value = _by_id(value, bad)
    groups: list[dict[str, Any]] = []
    names: dict[int, str] = {}
    seen: set[int] = set()
    for g, group in enumerate(value["param_groups"]):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), (list, tuple)):
            raise bad(f"param group {g} has no 'params' list")
        params = list(group["params"])
        if not all(is_int(p) for p in params):
            raise bad(f"param group {g} lists parameters that are not integer ids")
        if seen.intersection(params):
            raise bad(f"param group {g} repeats a parameter id of an earlier group")
        seen.update(params)
        group_names = group.get("param_names")
        if isinstance(group_names, (list, tuple)) and len(group_names) == len(params):
            for p, name in zip(params, group_names):
                if not isinstance(name, str):
                    raise bad(f"param group {g} has a parameter name that is not a string")
                names[p] = name
        groups.append({**{str(k): v for k, v in group.items()}, "params": params})
    state: dict[int, dict[str, Any]] = {}
    for pid, entry in value["state"].items():
        if not is_int(pid):
            raise bad(f"state is keyed by {quoted(pid)}, not by integer parameter ids")
        if pid not in seen:
            raise bad(f"state holds parameter {pid}, which no param group lists")
        if not isinstance(entry, Mapping):
            raise bad(f"state of parameter {pid} is not a mapping")
        state[pid] = {
            str(k): StoredTensor.whole(f"{pid}.{k}", v, file)
            if isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in entry.items()
        }
    complete = len(names) == len(seen)
    return OptimizerState(groups, state, names if complete and names else None, file, key)


def _by_id(value: Mapping, bad) -> Mapping:
    """A state dict keyed by parameter names, as torch's own ``get_optimizer_state_dict``
    (``torch.distributed.checkpoint.state_dict``) and FSDP's ``optim_state_dict`` give
    it, as the usual one: ids in group order, the names kept as ``param_names``."""
    groups = value["param_groups"]
    listed = [p for g in groups if isinstance(g, Mapping)
              for p in (g.get("params") if isinstance(g.get("params"), (list, tuple)) else ())]
    if not listed or not all(isinstance(p, str) for p in listed):
        return value
    ids = {name: i for i, name in enumerate(dict.fromkeys(listed))}
    if len(ids) < len(listed):
        raise bad("its param groups name a parameter twice")
    strangers = [k for k in value["state"] if k not in ids]
    if strangers:
        raise bad(f"state holds {quoted(strangers[0])}, which no param group names")
    return {
        "state": {ids[k]: v for k, v in value["state"].items()},
        "param_groups": [{**g, "params": [ids[p] for p in g["params"]],
                          "param_names": list(g["params"])} for g in groups],
    }
