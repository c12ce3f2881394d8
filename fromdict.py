"""A dataclass from a plain dict (a JSON file, a config table, a message's map) that refuses
keys it does not know: `from_dict(cls, d, what)`.

A misspelt or newer field is an error that names it and the fields there are, rather than a
`TypeError` about keyword arguments, or a setting silently dropped. Missing fields and each
field's type and range are the dataclass's own business (its defaults and `__post_init__`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

__all__ = ["from_dict"]

T = TypeVar("T")


def from_dict(cls: type[T], d: Mapping[str, Any], what: str,
              convert: Callable[[Any], Any] | None = None) -> T:
    """`cls(**d)` for the dataclass `cls`; ValueError if `d` has a key that is none of its
    fields (`what` names the thing in the message). `convert`, when given, is applied to every
    value first (after the keys are checked)."""
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown {what} fields {sorted(unknown)}; expected {sorted(names)}")
    if convert is not None:
        return cls(**{k: convert(v) for k, v in d.items()})
    return cls(**d)
