"""Typed reading of the JSON that Nimble's files hold: every value checked for its type as it is
read, and a value of the wrong type refused with one :class:`FieldError` that names the field by
its path in the file (``tasks[3].duration_us``, ``buffers[7][2]``).

A hand-edited or damaged file then fails where it is read, with a message that says which field
to fix, rather than deep inside the analysis with an error about an ``int`` and a ``str``.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import NimbleError


class FieldError(NimbleError, ValueError):
    """A field of a JSON file has the wrong type or shape; the message names it."""


_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
          int: "a number", float: "a number", type(None): "null"}


def describe(value: Any) -> str:
    """``value`` as the JSON it came from: its type, and the value itself where short."""
    kind = _NAMES.get(type(value), type(value).__name__)
    if isinstance(value, (dict, list)) or value is None:
        return kind
    shown = repr(value)
    return f"{kind} ({shown if len(shown) <= 24 else shown[:21] + '...'})"


def wrong(where: str, value: Any, expected: str) -> FieldError:
    return FieldError(f"{where} is {describe(value)}, not {expected}")


def integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong(where, value, "an integer")
    return value


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong(where, value, "a number")
    return value


def text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise wrong(where, value, "a string")
    return value


def flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise wrong(where, value, "true or false")
    return value


def obj(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise wrong(where, value, "an object")
    return value


def array(value: Any, where: str, length: int | tuple[int, int] | None = None) -> list:
    """``value`` as a list; ``length``: its exact length, or the ``(fewest, most)`` items."""
    if not isinstance(value, list):
        raise wrong(where, value, "an array")
    if length is not None:
        low, high = (length, length) if isinstance(length, int) else length
        if not low <= len(value) <= high:
            count = str(low) if low == high else f"{low} to {high}"
            raise FieldError(f"{where} has {len(value)} items, not {count}")
    return value


def items(value: Any, where: str, read: Callable[[Any, str], Any],
          length: int | tuple[int, int] | None = None) -> list:
    """Each item of the array ``value`` read by ``read(item, "where[i]")``."""
    return [read(item, f"{where}[{i}]") for i, item in enumerate(array(value, where, length))]


def member(data: dict, key: str, where: str, read: Callable[[Any, str], Any],
          default: Any = ...) -> Any:
    """``data[key]`` read by ``read``; a missing key takes ``default`` (required without one).
    ``where`` is the path of ``data`` in the file ("" for the top level)."""
    if key not in data:
        if default is ...:
            raise FieldError(f"{where or 'the file'} has no {key!r}")
        return default
    return read(data[key], f"{where}.{key}" if where else key)


def optional(read: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """``read``, with null read as None."""
    return lambda value, where: None if value is None else read(value, where)


def scalar(value: Any, where: str) -> Any:
    """A string, number, boolean or null: a leaf value of free meaning."""
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise wrong(where, value, "a string, number, boolean or null")
    return value
