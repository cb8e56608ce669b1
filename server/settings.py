"""One home per setting: a dataclass field carries its flag, default, validation and help.

    @dataclass(frozen=True)
    class EngineConfig:
        inference_slots: int = setting(8, "requests decoded together", check=at_least(1))

`add_arguments(parser, EngineConfig)` turns the fields into `--inference-slots`
and friends; `from_args(EngineConfig, namespace)` builds the config back, and the
checks run in `validate`, so a bad value exits with code 2 and a one-line reason
before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable

Check = Callable[[Any], str | None]  # returns the reason a value is bad, or None


def setting(default: Any, help: str, *, check: Check | None = None, flag: str | None = None,
            choices: tuple | None = None, repeat: bool = False) -> Any:
    meta = {"help": help, "check": check, "flag": flag, "choices": choices, "repeat": repeat}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def at_least(lo: float) -> Check:
    return lambda v: None if v is None or v >= lo else f"must be >= {lo}, got {v}"


def between(lo: float, hi: float) -> Check:
    return lambda v: None if v is None or lo <= v <= hi else f"must be in [{lo}, {hi}], got {v}"


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    if typing.get_origin(hint) in (list, tuple):
        return _base_type(typing.get_args(hint)[0])
    return hint if isinstance(hint, type) else str


def _declared_by(cls: type, name: str) -> type:
    """The class (cls or a base) whose body declares the field: a base's fields are grouped under it."""
    return next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    groups: dict[type, Any] = {cls: parser.add_argument_group(cls.__name__)}  # its own flags first
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        owner = _declared_by(cls, f.name)
        if owner not in groups:
            groups[owner] = parser.add_argument_group(owner.__name__)
        group = groups[owner]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = _base_type(hints[f.name])
        help_text = f"{f.metadata['help']} (default: {default!r})"
        if kind is bool:
            group.add_argument(_flag(f), dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif f.metadata["repeat"]:
            group.add_argument(_flag(f), dest=f.name, action="append", type=kind, default=None, help=help_text)
        else:
            group.add_argument(_flag(f), dest=f.name, type=kind, default=default, choices=f.metadata["choices"], help=help_text)


def validate(config: Any) -> None:
    """Raise ValueError with a one-line reason naming the flag."""
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        reason = check(getattr(config, f.name)) if check else None
        if reason:
            raise ValueError(f"{_flag(f)}: {reason}")


def from_args(cls: type, namespace: argparse.Namespace, **overrides: Any) -> Any:
    values = {}
    for f in dataclasses.fields(cls):
        if hasattr(namespace, f.name) and getattr(namespace, f.name) is not None:
            values[f.name] = getattr(namespace, f.name)
    values.update(overrides)
    config = cls(**values)
    validate(config)
    return config
