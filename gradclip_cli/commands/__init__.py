"""Each command's steps, one module per command; ``cli.py`` only declares and wires them.

A command module exposes ``run(...) -> int`` (the exit code) and is imported
only when its command runs, so ``gradclip --help`` never pays for torch.
"""
