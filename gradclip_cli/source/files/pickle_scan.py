"""Reading one integer entry of a ``torch.save`` file without unpickling it.

Some training states hold objects the weights-only unpickler refuses and
gradclip never needs: OLMo-core's ``train/rank0.pt`` holds numpy's RNG
state beside the trainer's ``global_step``. Rather than unpickle it (which
would run numpy's reconstructors), ``top_level_int`` walks the pickle's
opcodes with ``pickletools.genops``, which decodes and runs nothing, and
follows the top-level dict's items on a stack of stand-ins.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.untrusted import is_int

# A trainer's state pickle is a few KB; its tensors live in other zip entries.
MAX_PICKLE_BYTES = 16 << 20
_LITERALS = (
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "LONG4",
    "INT",
    "LONG",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
)
_MARK = object()


def top_level_int(path: Path, key: str) -> int | None:
    """``root[key]`` of the zip-format ``torch.save`` file ``path`` when ``root`` is a dict
    and that entry is an int literal; None when the key is absent or holds something else.
    ``InputError`` naming the file when it is not a readable torch zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise InputError(f"{path}: not a torch.save zip file (no single data.pkl)")
            info = archive.getinfo(names[0])
            if info.file_size > MAX_PICKLE_BYTES:
                raise InputError(
                    f"{path}: its pickle is {info.file_size} bytes, too large for a training state"
                )
            data = archive.read(info)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise InputError(
            f"{path}: not a readable torch.save zip file: {str(error)[:80]}"
        ) from None
    try:
        ops = [(op, arg) for op, arg, _ in pickletools.genops(data)]
    except Exception as error:  # pickletools raises ValueError and others on damage
        raise InputError(f"{path}: a damaged pickle: {str(error)[:80]}") from None
    try:
        value = _root_dict(ops).get(key)
    except (IndexError, ValueError):  # an opcode with too little on the stack, no mark
        raise InputError(f"{path}: a damaged pickle (its opcodes do not build a value)") from None
    return value if is_int(value) else None


def _root_dict(ops) -> dict:
    """The top-level dict's literal keys and values, by running the opcodes on a stack of
    stand-ins: literals are kept, every other object is an opaque token (each opcode's
    stack effect is pickletools' own ``stack_before``/``stack_after``)."""
    stack: list = []
    memo: dict = {}
    root: dict | None = None
    for op, arg in ops:
        name = op.name
        if name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo.get(arg, object()))
        elif name == "EMPTY_DICT":
            stack.append({})
            root = stack[-1] if root is None and len(stack) == 1 else root
        elif name in _LITERALS:
            stack.append(_Literal(arg))
        elif name == "MARK":
            stack.append(_MARK)
        elif name in ("SETITEM", "SETITEMS"):
            if name == "SETITEM":
                items = stack[-2:]
                del stack[-2:]
            else:
                at = len(stack) - 1 - stack[::-1].index(_MARK)
                items = stack[at + 1 :]
                del stack[at:]
            target = stack[-1]
            if isinstance(target, dict):
                for k, v in zip(items[::2], items[1::2]):
                    if isinstance(k, _Literal):
                        target[k.value] = v.value if isinstance(v, _Literal) else v
        elif name == "STOP":
            break
        else:
            before = op.stack_before
            if pickletools.markobject in before:
                at = len(stack) - 1 - stack[::-1].index(_MARK)
                del stack[at - before.index(pickletools.markobject) :]
            elif before:
                del stack[len(stack) - len(before) :]
            stack.extend(object() for _ in op.stack_after)
    return root if root is not None else {}


class _Literal:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value
