"""kvfork as a package: one import name, `kvfork`, over the checkout's server/, backends/ and tools/.

A checkout and an editable install import the same files; a wheel holds kvfork/ alone (never tests/);
no module is importable under two names; every module the product imports is a declared dependency,
with bounds where kvfork calls a library's private members; `kvfork --version`, `python -m kvfork`;
`make` refuses a Python older than 3.11 with one sentence. (tools/wheel_check.sh installs the wheel
into a fresh environment and serves from it, in CI.)"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import PackageNotFoundError, distributions, packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import kvfork

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("kvfork", *kvfork.SUBPACKAGES)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Imported by the product but not installed here: where each comes from.
NOT_INSTALLED_HERE = {"fla": "fla-core", "flash_attn": "flash-attn"}
LATER_STDLIB = {"compression"}  # the standard library's from Python 3.14 (compression.zstd), imported there alone


def run_python(code: str, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=True, **kwargs)


def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def imported_modules(path: Path) -> set[str]:
    """The absolute module names a file imports (the module of each `from m import x`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module)
    return out


def test_code_imports_the_subpackages_by_the_package_name():
    """`from server.x import` would load a second copy of server/ beside kvfork.server (from a checkout's
    root), or fail (from a wheel)."""
    offenders = {str(path.relative_to(ROOT)): sorted(bad) for path in python_files(*FOLDERS, "tests")
                 if (bad := {m for m in imported_modules(path) if m.split(".")[0] in kvfork.SUBPACKAGES})}
    assert offenders == {}


def test_no_module_is_importable_under_two_names():
    """The serving path and each command the CLI offers, imported in a fresh interpreter from the checkout's
    root: none of server/, backends/ or tools/ is in sys.modules under its folder's name."""
    from kvfork.server.cli import COMMANDS

    modules = ["kvfork.server.launch.serve", "kvfork.server.launch.distributed", "kvfork.backends.mlx.backend",
               "kvfork.backends.torch.backend", *(module for module, _ in COMMANDS.values())]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {kvfork.SUBPACKAGES!r} + ('tests',)))")
    assert run_python(code, ROOT).stdout.strip() == "[]"


def test_the_subpackages_are_links_a_reader_follows():
    """kvfork/server, kvfork/backends and kvfork/tools are links to the top-level folders, committed as links,
    so a tool that runs no code (an editor, the type checker) resolves `kvfork.server.x` to server/x.py."""
    links = {path.name: path for path in (ROOT / "kvfork").iterdir() if path.is_symlink()}
    assert sorted(links) == sorted(kvfork.SUBPACKAGES)
    assert all(path.resolve() == ROOT / name for name, path in links.items())
    staged = subprocess.run(["git", "ls-files", "-s", "kvfork"], cwd=ROOT, capture_output=True, text=True, check=True)
    modes = {line.split("\t")[1]: line.split()[0] for line in staged.stdout.splitlines()}
    assert {f"kvfork/{name}": "120000" for name in kvfork.SUBPACKAGES}.items() <= modes.items()


def test_a_checkout_imports_its_own_folders():
    """From a checkout's root its own folders are kvfork's subpackages, whichever checkout the environment
    has installed (a worktree tested with another's virtual environment runs its own code)."""
    code = "import kvfork.server, kvfork.backends.base, kvfork.tools.bench; print(kvfork.server.__file__)"
    assert Path(run_python(code, ROOT).stdout.strip()).resolve() == ROOT / "server" / "__init__.py"
    for name in ("tests", "build", "docs"):
        missing = subprocess.run([sys.executable, "-c", f"import kvfork.{name}"], cwd=ROOT, capture_output=True)
        assert missing.returncode != 0, name


def test_an_editable_install_imports_its_checkout_from_anywhere(tmp_path):
    # The installed one records where it came from (a checkout's kvfork.egg-info, first on sys.path, does not).
    records = [json.loads(text) for d in distributions(name="kvfork") if (text := d.read_text("direct_url.json"))]
    if not any(record.get("dir_info", {}).get("editable") for record in records):
        pytest.skip("kvfork is not installed from a checkout in this environment")
    (installed,) = records
    checkout = Path(installed["url"].removeprefix("file://"))
    code = "import kvfork.server.cli as cli, kvfork; print(cli.__file__); print(kvfork.__version__)"
    ran = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, f"the editable install of {checkout} is stale (make install redoes it): {ran.stderr}"
    module_file, module_version = ran.stdout.split()
    assert Path(module_file).resolve() == checkout.resolve() / "server" / "cli.py"
    script = Path(sys.executable).parent / "kvfork"
    if script.exists():
        assert subprocess.run([script, "--version"], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout == f"kvfork {module_version}\n"


def test_version_and_python_m_kvfork():
    """`python -m kvfork` is the `kvfork` command; its version is the package's and the installed one's."""
    said = subprocess.run([sys.executable, "-m", "kvfork", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert said.returncode == 0 and said.stdout == f"kvfork {kvfork.__version__}\n"
    usage = subprocess.run([sys.executable, "-m", "kvfork", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 0 and "fetch-model" in usage.stdout and "--version" in usage.stdout
    try:
        assert version("kvfork") == kvfork.__version__
    except PackageNotFoundError:
        pass


def test_every_subpackage_has_its_init():
    folders = [folder for name in FOLDERS for folder in [ROOT / name, *(ROOT / name).rglob("*")] if folder.is_dir()]
    missing = sorted(str(folder.relative_to(ROOT)) for folder in folders
                     if any(folder.glob("*.py")) and not (folder / "__init__.py").is_file())
    assert missing == []


def test_setup_maps_the_subpackages_kvfork_finds():
    tree = ast.parse((ROOT / "setup.py").read_text())
    assigned = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == "SUBPACKAGES")
    assert ast.literal_eval(assigned) == kvfork.SUBPACKAGES


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel pip builds from a clean copy of the checkout (an in-tree build/ may hold stale files)."""
    source, out = tmp_path_factory.mktemp("source") / "kvfork", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
                   check=True, capture_output=True, timeout=300)
    (path,) = out.glob("kvfork-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_kvfork_alone(wheel):
    names = wheel.namelist()
    info = f"kvfork-{kvfork.__version__}.dist-info/"
    assert {name.split("/")[0] for name in names} == {"kvfork", info.rstrip("/")}
    assert wheel.read(info + "top_level.txt").decode().split() == ["kvfork"]
    assert not [name for name in names if re.search(r"(^|/)(tests?|build|conftest)(/|\.py$)", name)]
    packages = {name.rpartition("/")[0] for name in names if name.endswith(".py")}
    assert all(f"{package}/__init__.py" in names for package in packages)
    modules = {str(path.relative_to(ROOT)) for folder in kvfork.SUBPACKAGES for path in (ROOT / folder).rglob("*.py")}
    assert {name.removeprefix("kvfork/") for name in names if name.endswith(".py") and name.count("/") > 1} == modules
    assert "kvfork = kvfork.server.cli:main" in wheel.read(info + "entry_points.txt").decode()
    assert {"kvfork/tools/clients/package.json", "kvfork/tools/clients/package-lock.json"} <= set(names)


def test_the_wheel_metadata(wheel):
    metadata = wheel.read(f"kvfork-{kvfork.__version__}.dist-info/METADATA").decode()
    fields = {}
    for line in metadata.split("\n\n")[0].splitlines():
        key, _, value = line.partition(": ")
        fields.setdefault(key, []).append(value)
    assert fields["License-Expression"] == ["MIT"] and fields["License-File"] == ["LICENSE"]
    assert fields["Requires-Python"] == [">=3.11"] and fields["Author"] == ["the kvfork authors"]
    assert set(fields["Provides-Extra"]) >= {"cuda", "cluster", "kv-events", "kv-router", "dev"}
    assert any(c.startswith("Operating System :: MacOS") for c in fields["Classifier"])
    assert "MIT License" in wheel.read(f"kvfork-{kvfork.__version__}.dist-info/licenses/LICENSE").decode()


def _declared() -> dict[str, list[Requirement]]:
    """Every requirement pyproject.toml declares, by normalized distribution name (base and extras)."""
    out: dict[str, list[Requirement]] = {}
    for line in PYPROJECT["dependencies"] + sum(PYPROJECT["optional-dependencies"].values(), []):
        requirement = Requirement(line)
        out.setdefault(re.sub(r"[-_.]+", "-", requirement.name).lower(), []).append(requirement)
    return out


def test_every_module_the_product_imports_is_declared():
    """An AST scan of kvfork/, server/, backends/, tools/: each library they import (at the top or inside a
    function) is a requirement in pyproject.toml, in the base set or an extra."""
    ours = set(FOLDERS) | {"kvfork"}
    tops = {m.split(".")[0] for path in python_files(*FOLDERS) for m in imported_modules(path)}
    libraries = tops - ours - set(sys.stdlib_module_names) - LATER_STDLIB - {"__future__"}
    declared, owners = _declared(), packages_distributions()
    undeclared = {}
    for module in sorted(libraries):
        names = owners.get(module) or [NOT_INSTALLED_HERE.get(module, module)]
        if not any(re.sub(r"[-_.]+", "-", name).lower() in declared for name in names):
            undeclared[module] = names
    assert undeclared == {"flash_attn": ["flash-attn"]}  # no wheels on PyPI: the README gives its install
    assert "pip install flash-attn --no-build-isolation" in (ROOT / "README.md").read_text()


def test_serving_needs_no_extra_and_the_mac_gets_no_torch():
    base = [Requirement(line) for line in PYPROJECT["dependencies"]]
    on = {platform: {r.name for r in base if r.marker is None or r.marker.evaluate({"sys_platform": platform})}
          for platform in ("linux", "darwin")}
    serving = {"mlx", "mlx-lm", "aiohttp", "msgspec", "transformers", "tokenizers", "llguidance"}
    assert serving | {"torch"} <= on["linux"] and serving <= on["darwin"] and "torch" not in on["darwin"]
    assert "cpu" in next(r for r in base if r.name == "mlx" and r.marker.evaluate({"sys_platform": "linux"})).extras
    dev = {Requirement(line).name for line in PYPROJECT["optional-dependencies"]["dev"]}
    assert not dev & (on["linux"] | on["darwin"])


@pytest.mark.parametrize("library, module", [
    ("mlx-lm", "kvfork.backends.mlx.mlx_lm_caches:MLX_LM_VERSIONS"),
    ("torch", "kvfork.backends.torch.packed_linear:TORCH_VERSIONS"),
])
def test_each_private_api_bound_is_the_range_checked(library, module):
    """kvfork calls these libraries' private members, each in one adapter that names the versions it was
    checked for: pyproject.toml pins that range, and the installed version lies in it."""
    pytest.importorskip(library.replace("-", "_"))
    import importlib

    name, _, attribute = module.partition(":")
    checked = SpecifierSet(getattr(importlib.import_module(name), attribute))
    pins = _declared()[library]  # each declaration (the base's, an extra's for another platform) pins it
    assert pins and all(pinned.specifier == checked for pinned in pins)
    assert version(library).split("+")[0] in checked


def test_make_refuses_a_python_too_old_in_one_sentence(tmp_path):
    old = tmp_path / "python3"
    old.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.10.12" && exit 0\nexit 1\n')
    old.chmod(0o755)
    venv = tmp_path / "venv"
    made = subprocess.run(["make", "-s", "-C", str(ROOT), "install", f"PYTHON={old}", f"VENV={venv}"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode != 0 and not venv.exists()
    first = made.stderr.splitlines()[0]
    assert first.startswith(f"kvfork needs Python 3.11 or newer, and {old} is Python 3.10.12: install Python 3.11+")
    assert first.endswith("run make again with PYTHON=python3.12 (or python3.11).")


def test_every_tool_imports():
    """Each module under tools/ imports (a tool nothing runs in the suite would otherwise break unseen);
    only an optional third-party package that is not installed may stop one."""
    modules = sorted("kvfork.tools." + ".".join(p.relative_to(ROOT / "tools").with_suffix("").parts)
                     for p in (ROOT / "tools").rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    code = ("import importlib, json\nbroken = {}\n"
            f"for m in {modules!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if (e.name or '').split('.')[0] == 'kvfork':\n            broken[m] = str(e)\n"
            "    except ImportError as e:\n        broken[m] = str(e)\n"
            "print(json.dumps(broken))")
    assert json.loads(run_python(code, ROOT).stdout.strip().splitlines()[-1]) == {}
