"""Checks of values read from untrusted dicts: a checkpoint's pickle, a JSON file, a log.

Python's ``bool`` is an ``int`` (``True == 1``), so a count read from a file is an
int that is not a bool, and a number is an int or a float that is not a bool.
"""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object, least: int = 0) -> bool:
    """An int, not a bool, at least ``least`` (0: a count; 1: a size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
