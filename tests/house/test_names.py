"""One meaning per name: every class of the product (server/, backends/, tools/) has a name no other class
there has, so a name read anywhere (a log, a traceback, docs/architecture.md) says which class it is."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("server", "backends", "tools")


def class_definitions() -> dict[str, list[str]]:
    """Class name -> where each class of that name is defined (file:line), nested classes included."""
    where = defaultdict(list)
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return where


def test_the_scan_sees_every_class():
    where = class_definitions()
    assert [place.partition(":")[0] for place in where["Engine"]] == ["server/engine/engine.py"]
    assert len(where) > 300 and "Row" in where


def test_every_class_name_is_defined_once():
    assert {name: places for name, places in class_definitions().items() if len(places) > 1} == {}
