"""Parsing JSON that came from a file: every malformed document is one ``InputError``.

Indexes, ``trainer_state.json``, ``config.json``, DCP's ``DCP_SHARDING_INFO``
and the monitor's JSON Lines logs are all parsed by ``parse_json``. Python's
``json`` turns hostile text into errors no user should see: an integer of
5,000 digits is a bare ``ValueError`` (int's digit limit), one of 400 digits
parses and later overflows ``float``, and deep nesting is a
``RecursionError``. Here each is refused while parsing, with one line naming
the file and the place (line and column).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gradclip_cli.errors import InputError

# No count, size or norm gradclip reads needs more digits (a float holds at most
# 309 before the point); far below int's own limit of 4,300 (CPython's int_max_str_digits).
MAX_INTEGER_DIGITS = 100

_DEPTH = 500  # where a message places too deep a nesting (Python's own limit is higher)
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]')


class _OutOfRange(Exception):
    def __init__(self, text: str, why: str):
        super().__init__(text)
        self.text = text
        self.why = why


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _OutOfRange(
            text, f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INTEGER_DIGITS})"
        )
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # a literal, not "Infinity": past float's range
        raise _OutOfRange(text, "a number too large for a float")
    return value


def parse_json(data: bytes | str, *, where: str, what: str = "JSON", line: bool = False) -> Any:
    """The document in ``data``; ``InputError`` "``where``: not ``what``: <why, where>".

    ``where`` names the file (and the line, for one line of a log: ``line``,
    whose places are then columns alone), raw: the message is escaped once, whole, where
    it is shown.
    """
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{where}: not {what}: not UTF-8 text (byte {error.start})") from None
    try:
        return json.loads(data, parse_int=_integer, parse_float=_float)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{where}: not {what}: not valid JSON ({error.msg} at {_place(data, line, error.pos)})"
        ) from None
    except _OutOfRange as error:
        at = _place(data, line, data.find(error.text))
        raise InputError(f"{where}: not {what}: {error.why} at {at}") from None
    except RecursionError:
        raise InputError(
            f"{where}: not {what}: nested too deeply (past {_DEPTH} levels "
            f"at {_place(data, line, _deepest(data))})"
        ) from None
    except (ValueError, OverflowError) as error:  # anything else json lets through
        raise InputError(f"{where}: not {what}: not valid JSON ({type(error).__name__})") from None


def _place(text: str, line: bool, pos: int) -> str:
    if pos < 0:
        return "an unknown place"
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    if line:  # one line of a JSON Lines log: its number is in ``where``
        return f"column {column}"
    return f"line {text.count(chr(10), 0, pos) + 1} column {column}"


def _deepest(text: str, depth_limit: int = _DEPTH) -> int:
    """Where the nesting first passes ``depth_limit`` (strings skipped); -1 if it never does.
    Run only once parsing has failed, so its cost is the failure's."""
    depth = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > depth_limit:
                return match.start()
        elif token in "]}":
            depth -= 1
    return -1
