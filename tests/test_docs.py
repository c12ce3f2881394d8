"""The docs follow the code: every link between the pages resolves, the README's layout and its
table of parts name every layer folder, its command list names every `dtfm-peer` command the
CLI has, and the modules docs/control.md's table describes exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from dtfm.peer.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_to_a_page_of_the_repository_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.name}: {broken}"


def test_the_checker_finds_a_heading_as_github_names_it():
    assert heading_anchor("Reading `dtfm-peer status`") == "reading-dtfm-peer-status"
    assert heading_anchor("On one GPU (H200)") == "on-one-gpu-h200"


def _readme_block(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return section


def test_the_readme_layout_names_every_layer_folder():
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests", "bench"}
    listed = set(re.findall(r"(\w+)/", _readme_block("Layout").split("\n    bin/")[0]))
    assert folders <= listed, f"README's layout misses {sorted(folders - listed)}"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf command under `parser` (`("train", "start")`, `("status",)`)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [path]
    return [c for name, sub in subs[0].choices.items() for c in _commands(sub, (*path, name))]


def test_the_readme_command_list_names_every_dtfm_peer_command():
    listed = _readme_block("All commands")
    commands = _commands(build_parser())
    assert ("train", "status") in commands and ("export",) in commands
    missing = [" ".join(c) for c in commands if f"dtfm-peer {' '.join(c)}" not in listed]
    assert not missing, f"README's command list misses dtfm-peer {missing}"


def test_the_readme_parts_table_has_a_row_per_layer():
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests", "bench"}
    rows = set(re.findall(r"^\| `dtfm\.(\w+)` \|", _readme_block("What is here"), re.M))
    assert folders == rows, f"README's table: missing {sorted(folders - rows)}, extra {sorted(rows - folders)}"


def test_the_modules_control_md_names_exist():
    # docs/control.md's table of the plane's modules says what each owns and does; a module moved
    # or renamed must move in the table too
    text = (ROOT / "docs" / "control.md").read_text()
    table = text.split("| module | owns and does |", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"^\| `([\w/]+\.py)`", table, re.M)
    assert len(named) >= 10
    missing = [m for m in named if not (ROOT / "control" / m).exists()]
    assert not missing, f"docs/control.md names modules that control/ does not have: {missing}"
