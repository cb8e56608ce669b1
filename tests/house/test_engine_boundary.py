"""Modules meet through public verbs: nothing in the product or its tools reads or writes another object's
private member (ruff's SLF001 rule, checked here with the AST), so the engine's managers (Admission,
Index, NamedSessions, DiskTier) keep their parts to themselves, and renaming a part cannot pass for
hiding it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The places that call a library's private API, each its one adapter: mlx-lm's cache members, torch's
# oneDNN ops and its fused CPU attention with the log-sum-exp (torch names them with a leading underscore).
ADAPTERS = {"backends/mlx/mlx_lm_caches.py", "backends/torch/packed_linear.py", "backends/torch/cpu_attention.py"}
# The standard library's documented functions whose names begin with an underscore.
STDLIB_PUBLIC = {"os._exit"}


def private_accesses(source: str) -> list[str]:
    """`x._name` where x is not `self` or `cls` (nor, inside class C, `C` itself)."""
    found = []

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Attribute) and child.attr.startswith("_") and not child.attr.startswith("__"):
                base = child.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls", owner)) \
                        and ast.unparse(child) not in STDLIB_PUBLIC:
                    found.append(f"line {child.lineno}: {ast.unparse(child)}")
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id in ("getattr", "setattr"):
                name = child.args[1] if len(child.args) > 1 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_") \
                        and not name.value.startswith("__"):
                    found.append(f"line {child.lineno}: {child.func.id} of {name.value}")
            visit(child, owner)

    visit(ast.parse(source), None)
    return found


def test_the_check_finds_what_it_looks_for():
    source = ("adm._queue.append(r)\nengine._admission.next()\ngetattr(c, '_idx')\nself._x = 1\n"
              "class C:\n    n = 0\n    def f(self):\n        C._n += 1\n        other._y\n")
    assert private_accesses(source) == ["line 1: adm._queue", "line 2: engine._admission", "line 3: getattr of _idx",
                                        "line 9: other._y"]
    assert private_accesses("engine.admission.next()\nx.__class__\ngetattr(c, 'offset')\nos._exit(1)\n") == []


def test_no_module_reaches_into_another_objects_private_members():
    offenders = {}
    for folder in ("kvfork", "server", "backends", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in ADAPTERS and (found := private_accesses(path.read_text())):
                offenders[name] = found
    assert offenders == {}
