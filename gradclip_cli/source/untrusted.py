"""Checks of values read from untrusted dicts (a pickle's, a JSON file's, a log's):
Python's ``bool`` is an ``int`` (``True == 1``), and no count or number read is one."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object, least: int = 0) -> bool:
    """An int, not a bool, at least ``least`` (0: a count; 1: a size)."""
    return is_int(value) and value >= least


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
