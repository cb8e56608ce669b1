"""One meaning per name: every class of the product (server/, backends/, tools/) has a name no other class
there has, so a name read anywhere (a log, a traceback, docs/architecture.md) says which class it is; and each name
docs/architecture.md's glossary quotes is one the product defines."""

from __future__ import annotations

import ast
import re
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
    assert [place.partition(":")[0] for place in where["Engine"]] == ["server/engine/loop/engine.py"]
    assert len(where) > 300 and "Row" in where


def test_every_class_name_is_defined_once():
    assert {name: places for name, places in class_definitions().items() if len(places) > 1} == {}


# what the glossary quotes from other projects (mlx-lm's cache, MLX's kernel), not kvfork's own
FOREIGN = {"LRUPromptCache", "mx.quantized_matmul"}


def glossary_names() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    glossary = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    quoted = [name.split()[0] for name in re.findall(r"`([^`]+)`", glossary)]  # `--clone-mode share`: the flag
    return [name for name in quoted if re.match(r"-*[A-Za-z_]", name) and name not in FOREIGN]  # not `[0, upto)`


def test_the_glossary_names_what_the_code_has():
    """Each name the glossary quotes is defined in the product: a file, a class, a function or method, a field,
    or a flag (its setting's field)."""
    files = {path.name for top in PRODUCT for path in (ROOT / top).rglob("*.py")}
    source = "\n".join(path.read_text() for top in PRODUCT for path in (ROOT / top).rglob("*.py"))
    missing = []
    for name in glossary_names():
        if name.endswith(".py"):
            found = Path(name).name in files
        elif name.startswith("--"):
            found = re.search(rf"\b{name[2:].replace('-', '_')}\b", source) is not None
        else:
            last = re.split(r"[^\w.]", name)[0].split(".")[-1]
            found = re.search(rf"(def |class )?\b{last}\b\s*[(:=]", source) is not None
        if not found:
            missing.append(name)
    assert missing == []
