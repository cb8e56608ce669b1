"""kvfork: an LLM serving daemon that never computes the same prompt prefix twice.

The distribution's one import name. Its subpackages keep the checkout's top-level folders:
`kvfork.server` is server/, `kvfork.backends` is backends/, `kvfork.tools` is tools/ (setup.py maps
them, so a wheel holds kvfork/server/... and an editable install points at the folders). Run from a
checkout's root, the checkout's own folders are the subpackages whatever is installed: a worktree
tested with another checkout's virtual environment runs its own code.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

SUBPACKAGES = ("server", "backends", "tools")


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds kvfork.server, kvfork.backends and kvfork.tools in the checkout beside this package."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in SUBPACKAGES:
            return None
        folder = self.root / name
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _in_checkout() -> Path | None:
    """The checkout's root when this package is a checkout's kvfork/ (not an installed wheel's)."""
    here = Path(__file__).resolve().parent
    if (here / "server").is_dir():
        return None
    root = here.parent
    return root if all((root / name / "__init__.py").is_file() for name in SUBPACKAGES) else None


if (_root := _in_checkout()) is not None:
    sys.meta_path.insert(0, _CheckoutFolders(_root))
