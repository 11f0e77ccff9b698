"""Each command's steps, one module per command; ``cli.py`` only declares and wires them.

A command module (``inspect``, ``clip``, ``compare``, ``trend``, ``autopsy``)
exposes ``run(...) -> int`` (the exit code) and is imported only when its
command runs, so ``gradclip --help`` never pays for torch. Each reads as the
wiring of source -> measure -> report -> format | sink, from the steps they
share: ``common`` (load a checkpoint, ``measure`` it), ``output`` (where the
report goes), ``grouped`` (one checkpoint's group norms), ``previous``,
``outliers`` and ``norm_audit`` (one command's step each).
"""
