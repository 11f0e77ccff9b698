"""Beyond one process: gradclip under a launcher, and DTensor gradients.

Combining pieces across ranks is the core's ``PowerSums`` math plus one
collective; this package holds the collective so the core stays free of
process groups.

* ``launcher``: the process group of a CLI run under ``torchrun`` (or any
  launcher that sets ``RANK``/``WORLD_SIZE``), and the exchange that every
  rank's outcome, results or error, travels through.
* ``pieces``: which rank reads which piece (a tensor of a file, later a shard
  or a DCP chunk), split by bytes.
* ``combine``: per-tensor power sums gathered once and put back in
  single-process order, so the report is the same to the last digit.
* ``dtensor``: the drop-ins' total norm over DTensor gradients.

Importing this package does not import torch; the CLI asks ``launched()``
before any command runs.
"""

from .launcher import launched

__all__ = ["launched"]
