"""The tag names gradclip logs under in a tracker, one scheme for every writer and reader.

The contract fixes them: what the training-loop adapters log through a
framework's logger, what ``GradMonitor(tensorboard=...)`` writes, and what
``trend`` reads back from TensorBoard, MLflow, trackio, W&B or a Trainer's
``trainer_state.json``. A group's tag carries the monitor log's group name.
"""

from __future__ import annotations

PREFIX = "gradclip/"
TOTAL_NORM = "gradclip/total_norm"
GROUP_NORM_PREFIX = "gradclip/norm/"
CLIP_COEF = "gradclip/clip_coef"
SPIKE = "gradclip/spike"
# p, logged only where it is not 2 (absent means the 2-norm).
NORM_TYPE = "gradclip/norm_type"


def group_norm(group: str) -> str:
    """The tag of one group's norm."""
    return GROUP_NORM_PREFIX + group


def group_of(tag: str) -> str | None:
    """The group a ``gradclip/norm/<group>`` tag names, else None."""
    if tag.startswith(GROUP_NORM_PREFIX) and len(tag) > len(GROUP_NORM_PREFIX):
        return tag[len(GROUP_NORM_PREFIX) :]
    return None
