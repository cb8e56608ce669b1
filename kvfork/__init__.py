"""kvfork: an LLM serving daemon that never computes the same prompt prefix twice.

The distribution's one import name. Its subpackages keep the checkout's top-level folders:
`kvfork.server` is server/, `kvfork.backends` is backends/, `kvfork.tools` is tools/. In a checkout,
kvfork/server, kvfork/backends and kvfork/tools are links to those folders, so Python's own import
system, an editor or a type checker finds `kvfork.server.cli` at kvfork/server/cli.py, that is
server/cli.py, without running any code of ours; run from a checkout's root, the checkout's own folders
are the subpackages whatever is installed (a worktree tested with another checkout's virtual
environment runs its own code). setup.py maps the same names for the wheel and an editable install.
"""

__version__ = "0.1.0"

SUBPACKAGES = ("server", "backends", "tools")  # the links beside this file
