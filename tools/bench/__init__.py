"""The replay benchmark: `kvfork bench` (see cli.py for the commands)."""

from kvfork.tools.bench.cli import main

__all__ = ["main"]
