"""The package layout; the metadata is in pyproject.toml.

The distribution's one import name is `kvfork`, but its subpackages stay at the checkout's top level
(the project's layout): kvfork.server is server/, kvfork.backends is backends/, kvfork.tools is
tools/. tests/ is never part of it.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("server", "backends", "tools")  # kvfork/__init__.py's too

packages = ["kvfork"]
for top in SUBPACKAGES:
    packages += [f"kvfork.{top}", *(f"kvfork.{top}.{sub}" for sub in find_packages(top))]

setup(
    packages=packages,
    package_dir={"kvfork": "kvfork", **{f"kvfork.{top}": top for top in SUBPACKAGES}},
    # `kvfork clients --install` installs from these (tools/clients/run.py)
    package_data={"kvfork.tools.clients": ["package.json", "package-lock.json"]},
)
