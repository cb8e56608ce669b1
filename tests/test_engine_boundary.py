"""The engine core is one object (server/engine/engine.py): no other module touches its private members."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWNER = ROOT / "server" / "engine" / "engine.py"


def _names_engine(node: ast.expr) -> bool:
    """`engine`, `self.engine`, `x.engine`, `self._engine`: an expression that holds the Engine."""
    if isinstance(node, ast.Name):
        return node.id in ("engine", "_engine")
    return isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")


def private_engine_accesses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _names_engine(node.value):
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr"):
            if node.args and _names_engine(node.args[0]):
                found.append(f"line {node.lineno}: {node.func.id} on the engine")
    return found


def test_the_check_finds_what_it_looks_for():
    assert sorted(private_engine_accesses("engine._start(r)\nself.engine._requests.get(1)\ngetattr(engine, n)\n")) == [
        "line 1: ._start", "line 2: ._requests", "line 3: getattr on the engine"]
    assert private_engine_accesses("engine.start_request(r)\nengine.__class__\nother._x\n") == []


def test_no_module_but_engine_py_reaches_into_the_engine():
    offenders = {}
    for folder in ("server", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != OWNER and (found := private_engine_accesses(path.read_text())):
                offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}
