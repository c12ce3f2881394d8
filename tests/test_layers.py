"""The folders are layers, and every import points down.

Each package may import only the packages listed for it in `ALLOWED`, and only through the
names in that package's `__all__`. Imports inside functions and under `TYPE_CHECKING` count the
same as module-level ones: a cycle hidden in a function is still a cycle. docs/daemon.md shows
the same table.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom up. A package may import the packages in its set, and nothing else of dtfm. `lazy`
# (one module: a package's lazy exports), `files` (files replaced whole), `fromdict` (a
# dataclass from a dict, unknown keys refused) and `cli_base` (what the command-line tools
# share) are below them all.
_BASE = frozenset({"lazy", "files", "fromdict"})
ALLOWED: dict[str, frozenset[str]] = {
    "lazy": frozenset(),
    "files": frozenset(),
    "fromdict": frozenset(),
    "cli_base": frozenset(),
    "scenarios": frozenset(),
    "net": _BASE | {"scenarios"},
    "sched": _BASE | {"cli_base", "scenarios"},
    # sched's layer split (`layer_ranges`, which Plan.grid shares with the scheduler) and its
    # codec cost type (`CodecSpeed`, which train/compress/calibrate.py measures for it)
    "train": _BASE | {"cli_base", "sched"},
    "gossip": _BASE | {"net", "scenarios"},
    "control": _BASE | {"scenarios", "net", "sched", "train", "gossip"},
    "peer": _BASE | {"cli_base", "scenarios", "net", "sched", "train", "gossip", "control"},
    "swarm": _BASE | {"cli_base", "scenarios", "net", "sched", "train", "gossip", "control", "peer"},
}

# Third-party packages a layer must not import directly: the scheduler knows no network and no
# torch; the training math knows no event loop or sockets; the transport knows no torch.
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "scenarios": frozenset({"torch", "trio", "nacl", "msgpack"}),
    "sched": frozenset({"torch", "trio", "nacl", "msgpack"}),
    "train": frozenset({"trio", "nacl", "socket"}),
    "net": frozenset({"torch"}),
}


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


@functools.cache
def _tree(source: str, filename: str) -> ast.Module:
    """A module's syntax tree, parsed once for the tests that read every module."""
    return ast.parse(source, filename)


def _imports(tree: ast.AST, where: list[str]) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute module, imported names) for every import anywhere in the tree of a module
    of the package `where` (["dtfm", "control", "election"]); a relative import that climbs
    above dtfm gives the module "" ."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((node.lineno, alias.name, ()))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module or ""
            elif node.level > len(where):
                module = ""
            else:
                base = where[: len(where) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, module, tuple(a.name for a in node.names)))
    return out


def check_source(source: str, package: str, filename: str, exports: dict[str, set[str]]) -> list[Violation]:
    """Violations of the layer rules in one module of `package`; `filename` (relative to the
    repository root) places the module in a subpackage, for its relative imports."""
    folders = list(Path(filename).parent.parts)
    where = ["dtfm"] + (folders if folders[:1] == [package] else [package])
    found = []
    for line, module, names in _imports(_tree(source, filename), where):
        if not module:
            found.append(Violation(filename, line, "a relative import climbs above dtfm"))
            continue
        parts = module.split(".")
        top = parts[0]
        if top in FORBIDDEN_THIRD_PARTY.get(package, ()):
            found.append(Violation(filename, line, f"{package} must not import {top}"))
        if top != "dtfm":
            continue
        if len(parts) == 1:  # `from dtfm import net`, `from .. import x`
            targets = [n for n in names if n in ALLOWED] or ["dtfm"]
            for t in targets:
                if t == "dtfm" or t not in ALLOWED[package]:
                    found.append(Violation(filename, line, f"{package} imports dtfm.{t}"))
            continue
        target = parts[1]
        if target == package:
            continue
        if target not in ALLOWED:
            found.append(Violation(filename, line, f"{package} imports unknown package dtfm.{target}"))
            continue
        if target not in ALLOWED[package]:
            found.append(Violation(filename, line, f"{package} imports {module}: points up or sideways"))
            continue
        if len(parts) > 2:
            found.append(Violation(filename, line, f"{package} imports the module {module}: "
                                                   f"import names from dtfm.{target} instead"))
            continue
        private = [n for n in names if n not in exports.get(target, set())]
        if not names:
            found.append(Violation(filename, line, f"`import {module}`: import names from it"))
        elif private:
            found.append(Violation(filename, line, f"{package} imports {', '.join(private)} from "
                                                   f"dtfm.{target}, which is not in its __all__"))
    return found


def _packages() -> list[str]:
    return [p for p in ALLOWED if (ROOT / p / "__init__.py").exists()]


def _exports() -> dict[str, set[str]]:
    layers = _packages() + [p for p in ALLOWED if (ROOT / f"{p}.py").exists()]  # packages and the modules below them
    return {p: set(importlib.import_module(f"dtfm.{p}").__all__) for p in layers}


def test_every_top_level_package_has_a_layer():
    found = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert found - {"tests", "bench"} <= set(ALLOWED), found - set(ALLOWED)


@pytest.mark.parametrize("package", _packages())
def test_package_exports_are_declared_and_exist(package):
    mod = importlib.import_module(f"dtfm.{package}")
    assert isinstance(getattr(mod, "__all__", None), list), f"dtfm.{package} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"dtfm.{package}.__all__ names missing attributes: {missing}"
    assert len(set(mod.__all__)) == len(mod.__all__)


def test_every_import_points_down():
    exports = _exports()
    violations = []
    for package in _packages():
        for path in sorted((ROOT / package).rglob("*.py")):
            violations += check_source(path.read_text(), package, str(path.relative_to(ROOT)), exports)
    assert not violations, "\n".join(map(str, violations))


def test_dtfm_itself_imports_no_layer():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


EXPORTS = {"net": {"Transport"}, "gossip": {"GossipService"}, "peer": {"DaemonConfig"}, "sched": {"solve"}}


@pytest.mark.parametrize("source, package, expected", [
    ("from dtfm.net import Transport", "gossip", None),
    ("from dtfm.peer import DaemonConfig", "gossip", "points up"),
    ("def f():\n    from dtfm.peer import DaemonConfig", "net", "points up"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtfm.gossip import GossipService",
     "net", "points up"),
    ("from dtfm.sched import solve", "gossip", "points up or sideways"),
    ("from dtfm.net.transport import Transport", "gossip", "import names from dtfm.net instead"),
    ("from dtfm.net import _Secret", "gossip", "not in its __all__"),
    ("import dtfm.net", "gossip", "import names from it"),
    ("from ..peer import DaemonConfig", "net", "points up"),
    ("from .. import peer", "net", "imports dtfm.peer"),
    ("from . import frames", "net", None),
    ("from ..messages import ControlMsg", "control", "unknown package dtfm.messages"),
    ("import torch", "sched", "must not import torch"),
    ("import trio", "train", "must not import trio"),
])
def test_checker_catches_what_it_should(source, package, expected):
    found = check_source(source, package, "m.py", EXPORTS)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0].what, found


@pytest.mark.parametrize("source, filename, expected", [
    ("from ..net import Transport", "gossip/sub/m.py", None),  # dtfm.gossip.net: its own package
    ("from ...net import Transport", "gossip/sub/m.py", None),
    ("from ...peer import DaemonConfig", "gossip/sub/m.py", "points up"),
    ("from ....peer import DaemonConfig", "gossip/sub/m.py", "climbs above dtfm"),
    ("from . import frames", "gossip/sub/__init__.py", None),
    ("from ..runner import StepReport", "gossip/coordinator/m.py", None),
    ("from ...peer import DaemonConfig", "gossip/coordinator/m.py", "points up"),
])
def test_relative_imports_resolve_from_the_module_s_own_folder(source, filename, expected):
    found = check_source(source, "gossip", filename, EXPORTS)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0].what, found


@pytest.mark.parametrize("source, expected", [
    ("from ..messages import ControlMsg", None),  # dtfm.control.messages, its own package
    ("from ...net import Transport", None),
    ("from ...peer import DaemonConfig", "points up"),
    ("from ... import gossip", None),
])
def test_checker_resolves_relative_imports_in_a_subpackage(source, expected):
    found = check_source(source, "control", "control/dataplane/m.py", EXPORTS)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0].what, found


# ---- lazy exports ---------------------------------------------------------------------------

def _lazy_inits() -> list[str]:
    """The __init__.py files (relative to the root) that import their names on first use."""
    return [str(p.relative_to(ROOT)) for package in _packages() for p in sorted((ROOT / package).rglob("__init__.py"))
            if "LAZY_EXPORTS" in p.read_text()]


def _type_checking_imports(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """module -> names of the `from .x import ...` statements under `if TYPE_CHECKING:`."""
    out: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
                module = "." * stmt.level + (stmt.module or "")
                out[module] = out.get(module, ()) + tuple(a.asname or a.name for a in stmt.names)
    return out


def test_the_cli_path_packages_are_lazy():
    # the packages whose eager imports pulled torch and scipy (and trio and numpy: net, gossip)
    # into `dtfm-peer status`
    assert {"train/__init__.py", "control/__init__.py", "control/election/__init__.py",
            "control/dataplane/__init__.py", "net/__init__.py", "gossip/__init__.py"} <= set(_lazy_inits())


@pytest.mark.parametrize("init", _lazy_inits())
def test_lazy_exports_match_the_typed_imports_and_all(init):
    """What mypy sees (the TYPE_CHECKING imports), what the package hands out at run time
    (LAZY_EXPORTS) and what it declares public (__all__) name the same things, and every lazy
    name is the object its module defines."""
    module_name = "dtfm." + ".".join(Path(init).parent.parts)
    pkg = importlib.import_module(module_name)
    table = {m: tuple(names) for m, names in pkg.LAZY_EXPORTS.items()}
    assert _type_checking_imports(ast.parse((ROOT / init).read_text())) == table
    lazy = [n for names in table.values() for n in names]
    assert len(set(lazy)) == len(lazy)
    assert set(lazy) <= set(pkg.__all__), set(lazy) - set(pkg.__all__)
    for module, names in table.items():
        defining = importlib.import_module(module, module_name)
        for name in names:
            assert getattr(pkg, name) is getattr(defining, name), f"{module_name}.{name}"
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        getattr(pkg, "NoSuchName")


# ---- the sans-IO machines load no event loop and no torch -------------------------------------

# The decision code: the plane's two machines, its input layer, gossip's SWIM, the election's
# state and the scheduler. Each is driven by tables and simulations in plain Python, and must
# stay importable (and cheap to import) without trio or torch.
SANS_IO = ["dtfm.control.coordinator.machine", "dtfm.control.epoch.machine", "dtfm.control.inputs",
           "dtfm.gossip.swim", "dtfm.control.election.state", "dtfm.sched"]


@pytest.mark.parametrize("module", SANS_IO)
def test_the_machines_import_neither_trio_nor_torch(module):
    code = (f"import sys\nimport {module}\n"
            "print(sorted(m for m in ('trio', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split("\n")[-2] == "[]", (module, out.stdout, out.stderr)


def _product_sources() -> list[Path]:
    """Every .py file of the product: the tree under ROOT but tests/, bench/, build/, the hidden
    folders (the virtual environment) and control/testing/, none of which is walked."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        top = not rel.parts
        dirs[:] = [d for d in dirs if not (top and (d.startswith(".") or d in ("tests", "bench", "build")))
                   and (rel / d).parts != ("control", "testing")]
        out += [Path(folder) / f for f in files if f.endswith(".py")]
    return out


def test_no_product_module_imports_the_testing_package():
    """The simulations (dtfm.control.testing) are for tests and benchmarks; no product module
    depends on them."""
    found = []
    for path in sorted(_product_sources()):
        rel = path.relative_to(ROOT)
        for line, module, _ in _imports(_tree(path.read_text(), str(rel)), ["dtfm", *rel.parent.parts]):
            if module.startswith("dtfm.control.testing"):
                found.append(f"{rel}:{line}")
    assert not found, found
