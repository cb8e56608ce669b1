"""The package layout; the metadata is in pyproject.toml.

The distribution's one import name is `kvfork`, but its subpackages stay at the checkout's top level
(the project's layout): kvfork.server is server/, kvfork.backends is backends/, kvfork.tools is
tools/. tests/ is never part of it. The checkout's kvfork/server, kvfork/backends and kvfork/tools are
links to those folders, for readers that run no code; the mapping here is setuptools' own, so an editable
install maps the subpackages alone rather than putting the checkout's root on sys.path.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("server", "backends", "tools")  # kvfork/__init__.py's too: the links in kvfork/

packages = ["kvfork"]
for top in SUBPACKAGES:
    packages += [f"kvfork.{top}", *(f"kvfork.{top}.{sub}" for sub in find_packages(top))]

setup(
    packages=packages,
    package_dir={"kvfork": "kvfork", **{f"kvfork.{top}": top for top in SUBPACKAGES}},
    # `kvfork clients --install` installs from these (tools/clients/run.py); kv_reading.c is compiled where it
    # runs (backends/kv_reading.py)
    package_data={"kvfork.tools.clients": ["package.json", "package-lock.json"],
                  "kvfork.backends": ["kv_reading.c"]},
)
