"""No recursion whose depth grows with the input: prompts run to 150k tokens (thousands of trie blocks),
and Python stops at ~1,000 frames. Every function of the product that calls itself is listed here with
what bounds its depth; any other is a failure (walk with an explicit stack instead)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("server", "backends", "tools")

BOUNDED = {
    "server/settings.py:_base_type": "a type hint's nesting, written in the code",
    "server/settings.py:_toml_value": "a setting's value: a list of scalars, one level",
    "server/toolcalls/grammar_pieces.py:closed": "a schema's nesting, refused past --max-json-depth before it is "
                                                 "compiled",
    "server/engine/worker/faults.py:sample": "retries each row alone once (retried=True stops it)",
    "server/engine/loop/ending.py:complete": "a request ends its choices, which have none of their own",
    "tools/clients/fixtures.py:scrub": "a recorded request's JSON nesting",
}
# not recursion: each hands on to a method of the same name of another type, or calls a module's function
HANDS_ON = {
    "backends/torch/kv.py:reserve": "each layer's reserve",
    "server/api/respond.py:start": "each reply's start",
    "server/api/respond.py:whole": "each reply's whole",
    "server/generate/grammar.py:close": "each worker stream's close",
    "server/watch/metrics.py:render": "each metric's render",
    "server/launch/listening.py:listen": "server/launch/app.py's listen",
    "server/engine/loop/admission.py:give_way": "server/engine/policy/fair_share.py's give_way, the policy it asks",
}


def self_calls(path: Path) -> set[str]:
    """Functions of `path` whose body calls a function of their own name: `f(...)`, `self.f(...)`,
    `cls.f(...)`, or `x.f(...)` on a loop's variable (`for child in ...: child.f()`, a tree walk)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        looped = {n.id for loop in ast.walk(node) if isinstance(loop, (ast.For, ast.comprehension))
                  for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        for call in ast.walk(node):
            f = call.func if isinstance(call, ast.Call) else None
            direct = isinstance(f, ast.Name) and f.id == node.name
            method = (isinstance(f, ast.Attribute) and f.attr == node.name and isinstance(f.value, ast.Name)
                      and f.value.id in {"self", "cls", *looped})
            if direct or method:
                found.add(f"{path.relative_to(ROOT).as_posix()}:{node.name}")
    return found


def test_no_function_of_the_product_recurses_unless_its_depth_is_bounded():
    found = set().union(*(self_calls(p) for top in PRODUCT for p in (ROOT / top).rglob("*.py")))
    listed = set(BOUNDED) | set(HANDS_ON)
    assert found - listed == set(), "recursion over input: walk with an explicit stack"
    assert listed - found == set(), "listed, but no longer calling itself: drop it from the list"


def test_the_scan_finds_a_recursive_walk(tmp_path):
    """The scan itself: the index's old walk (a generator recursing into each child) is found."""
    (tmp_path / "walk.py").write_text(
        "class Node:\n    def below(self):\n        yield from self.entries\n"
        "        for child in self.children.values():\n            yield from child.below()\n"
        "def depth(tree):\n    return 1 + max(depth(c) for c in tree)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert self_calls(tmp_path / "walk.py") == {"walk.py:below", "walk.py:depth"}
    finally:
        ROOT = saved
