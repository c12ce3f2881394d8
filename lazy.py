"""Lazy exports of a package (PEP 562): each public name is imported from its module on first
use, so a command that needs only light parts of a package (`dtfm-peer status` reads the
daemon's config classes) does not load torch, scipy or the rest. A package keeps its names in a
table `module -> names`, imports them for type checkers under TYPE_CHECKING, and sets

    __getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())

tests/test_layers.py checks that each table, those imports and `__all__` name the same things.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: Mapping[str, tuple[str, ...]], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package` for the names in `table`;
    a name, once imported, is kept in `namespace` (the package's globals)."""
    module_of = {name: module for module, names in table.items() for name in names}

    def getattr_(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return getattr_, dir_
