"""The layers, from the code itself: a graph built with the AST (imports inside functions and under
`if TYPE_CHECKING:` included) shows no cycle among the package's modules (server/, backends/, tools/ and
kvfork/ itself), no edge from the product (server/, backends/) to tools/ (tools are entry points that
import the product, never the reverse), and no module importing a room above its own (ROOMS).
And no function of the product is longer than a reader takes in at once, and each API is one package
of server/api/, laid out alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvfork", "server", "backends", "tools")


def modules() -> dict[str, Path]:
    """Module name -> file: the folders are kvfork's subpackages (server/ is kvfork.server)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name if package == "kvfork" else f"kvfork.{name}"] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, wherever the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from a import b`: the module a.b when there is one, else a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_kind_of_import():
    edges = graph()
    assert "kvfork.server.engine.worker.runner" in edges["kvfork.server.engine.loop.engine"]  # a plain from-import
    # `from kvfork.server.engine import messages`:
    assert "kvfork.server.engine.messages" in edges["kvfork.server.engine.loop.admission"]
    assert "kvfork.backends.default_model" in edges["kvfork.server.launch.model_source"]  # an import inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle():
    """Over the whole package, not the engine alone: a cycle across folders (a backend's module and the
    GGUF cache it calls) is one too."""
    edges = graph()
    assert {"kvfork.server", "kvfork.backends", "kvfork.tools"} <= {v.rpartition(".")[0] for v in edges}
    assert cycles(edges) == []


def test_the_product_never_imports_tools():
    edges = graph()
    reaching = {v: sorted(w for w in ws if w.startswith("kvfork.tools")) for v, ws in edges.items()
                if v.startswith(("kvfork.server", "kvfork.backends"))}
    assert {v: ws for v, ws in reaching.items() if ws} == {}


# The rooms, from low to high: a module may import its own room and the rooms below it, never one above.
# A module's room is the longest entry that names its package.
ROOMS = (
    "kvfork",                       # the package's root: its version
    "kvfork.backends",              # the backends: the model's forward pass, its sessions and their KV state
    "kvfork.server.settings",       # the settings mechanism: each setting's flag, environment, default, check, help
    "kvfork.server.engine",         # the engine's contracts: api, config, messages
    "kvfork.server.engine.policy",  # pure policies
    "kvfork.server.engine.cache",   # the cache tiers
    "kvfork.server.engine.worker",  # the runner thread
    "kvfork.server.engine.loop",    # the control loop's state machine
    "kvfork.server.watch",          # metrics, KV events, the reuse view
    "kvfork.server.guard",          # what every request passes before any work
    "kvfork.server.text",           # tokenizer, template, detokenizer, stops
    "kvfork.server.toolcalls",      # the families' tool-call formats
    "kvfork.server.generate",       # tokens into replies
    "kvfork.server.common",         # the daemon's flags, the state every route reads
    "kvfork.server.api",            # the four APIs
    "kvfork.server.pool",           # several models behind one daemon
    "kvfork.server.routes",         # the routes beside the APIs'
    "kvfork.server.launch",         # starting the daemon, the application it listens with
    "kvfork.server",                # the command line
    "kvfork.tools",                 # benchmarks and checks over the product
    "kvfork.__main__",              # `python -m kvfork`
)

def room(module: str) -> int:
    """The module's room, as its height in ROOMS."""
    return max((i for i, r in enumerate(ROOMS) if module == r or module.startswith(r + ".")),
               key=lambda i: len(ROOMS[i]))


def test_no_module_imports_a_room_above_its_own():
    """Over the whole package: server/, backends/ and tools/."""
    edges = graph()
    assert room("kvfork.server.engine.loop.engine") > room("kvfork.server.engine") > room("kvfork.backends.base")
    upward = {(v, w) for v, ws in edges.items() for w in ws if room(w) > room(v)}
    assert upward == set(), "an arrow runs up: move the piece down, or pass it in"


LISTED = ("launch", "guard", "generate", "watch", "common", "engine", "engine/loop", "engine/worker", "engine/policy",
          "engine/cache")  # the rooms by purpose, whose listing is the map (docs/architecture.md)


def test_each_room_lists_its_modules():
    """A room's __init__ docstring names each of its modules, so a newcomer reads the map from it."""
    missing = []
    for name in LISTED:
        folder = ROOT / "server" / name
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        missing += [f"{name}/{p.name}" for p in sorted(folder.glob("*.py"))
                    if p.name != "__init__.py" and p.name not in doc]
    assert missing == []


def test_no_function_of_the_product_runs_over_60_lines():
    """A function a newcomer reads at once: none in server/ or backends/ is longer than 60 lines."""
    long = []
    for package in ("server", "backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


MAX_CLASS_LINES, MAX_MODULE_LINES = 350, 600


def class_weights(sources: dict[str, str]) -> dict[str, int]:
    """`module:Class` -> its lines together with those of every base class defined in `sources` (module name ->
    source), found in its own module or through a `from module import Name` there: a class split into mixins
    over shared state weighs what it is, one object. An interface (a class over abc.ABC or Protocol: backends/
    base.py's Backend, the contract every backend fills in) holds no state of its subclasses and weighs nothing
    in them; nor do bases from outside `sources` (Exception)."""
    own: dict[str, int] = {}
    bases: dict[str, list[str]] = {}
    interfaces: set[str] = set()
    for module, source in sources.items():
        tree = ast.parse(source)
        names = {alias.asname or alias.name: f"{node.module}:{alias.name}" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        names |= {node.name: f"{module}:{node.name}" for node in tree.body if isinstance(node, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                key = f"{module}:{node.name}"
                own[key] = node.end_lineno - node.lineno + 1
                bases[key] = [names[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in names]
                if {ast.unparse(b) for b in node.bases} & {"ABC", "abc.ABC", "Protocol"}:
                    interfaces.add(key)

    def ancestry(key: str, seen: set[str]) -> set[str]:
        for base in bases.get(key, ()):
            if base in own and base not in interfaces and base not in seen:
                seen.add(base)
                ancestry(base, seen)
        return seen

    return {key: lines + sum(own[b] for b in ancestry(key, set())) for key, lines in own.items()}


def test_a_class_weighs_its_bases():
    sources = {"a": "import abc\nclass Part:\n    x = 1\n    y = 2\nclass Contract(abc.ABC):\n    w = 0\n",
               "b": "from a import Contract, Part\nfrom typing import Protocol\n"
                    "class Whole(Part, Contract, Protocol):\n    z = 3\n"}
    assert class_weights(sources) == {"a:Part": 3, "a:Contract": 2, "b:Whole": 5}


def test_no_class_or_module_of_the_product_is_too_long():
    """A class a newcomer reads in one sitting: none in server/ or backends/ over 350 lines, its bases counted with
    it; no module over 600."""
    product = {name: path for name, path in modules().items() if name.startswith(("kvfork.server", "kvfork.backends"))}
    sources = {name: path.read_text() for name, path in product.items()}
    long = {name for name, source in sources.items() if len(source.splitlines()) > MAX_MODULE_LINES}
    long |= {key for key, lines in class_weights(sources).items() if lines > MAX_CLASS_LINES}
    assert long == set()


def test_each_api_is_one_package_laid_out_alike():
    """server/api/<api>/ holds an API's wire types, its reply and its route; every route calls the one
    shared preparation (server/api/prepare.py), and an API reaches into another only for its wire types
    (the chat request, which Messages and Responses translate into)."""
    api = ROOT / "server" / "api"
    apis = sorted(p.name for p in api.iterdir() if (p / "__init__.py").exists())
    assert apis == ["chat", "completions", "messages", "responses"]
    edges = graph()
    for name in apis:
        package = f"kvfork.server.api.{name}"
        assert {"protocol", "reply", "route"} <= {p.stem for p in (api / name).glob("*.py")}, name
        assert "kvfork.server.api.prepare" in edges[f"{package}.route"], name
        for module, targets in edges.items():
            if module.startswith(package + "."):
                others = {t for t in targets if t.startswith("kvfork.server.api.") and t.count(".") >= 4
                          and not t.startswith(package + ".")}
                assert all(t.endswith(".protocol") for t in others), (module, others)
