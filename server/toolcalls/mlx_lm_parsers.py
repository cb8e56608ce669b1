"""Families whose calls mlx-lm's own parsers read (`mlx_lm/tool_parsers/`).

Each of those modules has `parse_tool_call(text, tools)` and its markers
`tool_call_start` / `tool_call_end`; they parse a finished call, not a stream.
`MlxLmParser` is the stream around one: kvfork's hold-back finds the
markers (written out in each family's module, pinned against mlx-lm's by
tests/server/test_tool_family_grammars.py), and the text between them goes to mlx-lm's
parser. A body it refuses, one that names no offered tool, or one the reply
ends inside of (cut off by max_tokens) is the model's text.

The modules are loaded from mlx-lm's folder under a package of our own, without
running `mlx_lm/__init__.py`: that imports MLX and transformers' model code
(seconds), which a torch machine serving a GLM model has no use for.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from kvfork.server.toolcalls.base import MarkupToolParser, ParsedCall, openai_call_id

_PACKAGE = "kvfork_mlx_tool_parsers"


def mlx_lm_module(name: str) -> ModuleType:
    """mlx-lm's parser module `name` (glm47, kimi_k2, ...)."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")  # finds the folder without importing the package
        if spec is None or spec.origin is None:
            raise ImportError("mlx-lm is not installed: its tool parsers read this model's calls")
        folder = Path(spec.origin).parent / "tool_parsers"
        package_spec = importlib.util.spec_from_file_location(_PACKAGE, folder / "__init__.py",
                                                              submodule_search_locations=[str(folder)])
        assert package_spec is not None and package_spec.loader is not None
        package = importlib.util.module_from_spec(package_spec)
        sys.modules[_PACKAGE] = package
        package_spec.loader.exec_module(package)
    return importlib.import_module(f"{_PACKAGE}.{name}")


def as_calls(parsed: Any) -> list[ParsedCall] | None:
    """mlx-lm's result (a call dict or a list of them) as calls; None when any is not a call."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, arguments, call_id = item.get("name"), item.get("arguments", {}), item.get("id")
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        calls.append(ParsedCall(name, arguments, call_id if isinstance(call_id, str) and call_id else None))
    return calls or None


class MlxLmParser(MarkupToolParser):
    """A family read by mlx-lm's parser `reference` (a module name in mlx_lm/tool_parsers/)."""

    reference = ""
    unclosed_is_text = True  # the reference parsers read a cut-off call as a call with what it has

    def __init__(self, tools: list[dict] | None = None, make_id: Callable[[], str] = openai_call_id):
        super().__init__(tools, make_id)
        self.tool_list = [t for t in tools or () if t.get("type") == "function"]
        self._parse = mlx_lm_module(self.reference).parse_tool_call

    @classmethod
    def prepare(cls) -> None:
        mlx_lm_module(cls.reference)

    def parse_call(self, opening: str, body: str) -> list[ParsedCall] | None:
        try:
            calls = as_calls(self._parse(self.wrapped(opening, body), self.tool_list))
        except Exception:  # noqa: BLE001 - the reference parsers raise what they meet: the text is not a call
            return None
        if calls is None or any(call.name not in self.tools for call in calls):
            return None
        return calls

    def wrapped(self, opening: str, body: str) -> str:
        """The text mlx-lm's parser is given for a call (the body between the markers, as its server does)."""
        return body
