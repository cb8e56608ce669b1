"""Python subprocesses that import only kvfork's code, wherever they are started from.

`python -m kvfork.server` puts the working folder first on sys.path: started from a folder that holds a
`server/` (or `smg/`, `tools/`) package, the child would run that folder's code. A child here runs in
Python's isolated mode (-I: no working folder, no PYTHON* variables, no user site-packages) and
imports kvfork from the folder this very code was loaded from, named by its absolute path.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The folder kvfork's top-level package was imported from (a checkout's root, or site-packages)
ROOT = str(Path(sys.modules[__name__.partition(".")[0]].__file__ or __file__).resolve().parent.parent)
# sys.argv is ['-c', ROOT, module, *args]: kvfork's folder goes first on the path, then `module` runs as -m runs it
_RUN = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); module = sys.argv[2]; del sys.argv[1:3]; "
        "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs kvfork's `module` as `python -m module args...` would, isolated."""
    return [sys.executable, "-I", "-c", _RUN, ROOT, module, *args]

