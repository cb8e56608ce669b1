"""One home per setting: a dataclass field carries its flag, default, validation and help.

    @dataclass(frozen=True)
    class EngineConfig:
        inference_slots: int = setting(8, "requests decoded together", check=at_least(1))

`add_arguments(parser, ServerConfig, EngineConfig)` turns the fields into `--inference-slots`
and friends, grouped for `--help`; `from_args(EngineConfig, namespace)` builds the config back,
and the checks run in `validate`, so a bad value exits with code 2 and a one-line reason
before anything loads.

Each setting comes from one of four sources, the first that has it winning: a flag, the
environment (`KVFORK_<FIELD>`, e.g. KVFORK_MAX_CONTEXT; a list comma-separated), a TOML file
(`--config FILE`, keys spelled as the flags without their dashes, e.g. `max-context = 8192`),
its default. `layered` reads them all and says where each value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

Check = Callable[[Any], str | None]  # returns the reason a value is bad, or None
ENV_PREFIX = "KVFORK_"
# --help's sections, in order; a field's class names its default section (SETTINGS_GROUP)
GROUPS = ("model and device", "serving", "scheduling", "reuse", "limits")
KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
# Sizes: binary units (KiB...) and their one-letter short forms (K, M, G, T: as Docker and ulimit read
# them), decimal units (KB, MB, GB, TB), or a plain number of bytes.
_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "kb": 1000, "m": MiB, "mib": MiB, "mb": 1000**2,
          "g": GiB, "gib": GiB, "gb": 1000**3, "t": TiB, "tib": TiB, "tb": 1000**4}


def setting(default: Any, help: str, *, check: Check | None = None, flag: str | None = None,
            choices: tuple | None = None, repeat: bool = False, size: bool = False, group: str | None = None,
            aliases: tuple[str, ...] = (), secret: bool = False) -> Any:
    """`size`: bytes, read as 16GiB / 512MiB / 1.5GB too; `aliases`: other flags for it (vLLM's names);
    `secret`: never printed (--print-config shows how many)."""
    assert group is None or group in GROUPS
    meta = {"help": help, "check": check, "flag": flag, "choices": choices, "repeat": repeat, "size": size,
            "group": group, "aliases": aliases, "secret": secret}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def at_least(lo: float) -> Check:
    return lambda v: None if v is None or v >= lo else f"must be >= {lo}, got {v}"


def between(lo: float, hi: float) -> Check:
    return lambda v: None if v is None or lo <= v <= hi else f"must be in [{lo}, {hi}], got {v}"


def parse_size(text: str) -> int:
    """Bytes from `16GiB`, `512MiB`, `1.5GB`, `16G` or `1048576`; ValueError says what a size looks like."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 16GiB, 512MiB, 1.5GB, or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """The largest binary unit that keeps n readable: 16 GiB, 512 MiB, 1.5 KiB, 100 B."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def env_name(field: dataclasses.Field) -> str:
    return ENV_PREFIX + flag_of(field).lstrip("-").replace("-", "_").upper()


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    if typing.get_origin(hint) in (list, tuple):
        return _base_type(typing.get_args(hint)[0])
    return hint if isinstance(hint, type) else str


def _declared_by(cls: type, name: str) -> type:
    """The class (cls or a base) whose body declares the field: its SETTINGS_GROUP is the field's section."""
    return next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))


def _settings(*classes: type) -> list[tuple[dataclasses.Field, type, str]]:
    """(field, its value's type, its --help section) for every setting of the classes, in --help's order."""
    out = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                section = f.metadata["group"] or _declared_by(cls, f.name).__dict__["SETTINGS_GROUP"]
                out.append((f, _base_type(hints[f.name]), section))
    return sorted(out, key=lambda item: GROUPS.index(item[2]))


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def shown(f: dataclasses.Field, value: Any) -> str:
    """A value as a user reads it: sizes in binary units, booleans as on/off, secrets hidden."""
    if f.metadata["secret"] and value:
        return f"({len(value) if isinstance(value, list) else 1} hidden)"
    if f.metadata["size"] and isinstance(value, int):
        return format_size(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


_METAVARS: dict[Any, str] = {"size": "SIZE", int: "N", float: "X"}


def add_arguments(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Every setting of the classes as a flag, in --help's sections. A flag's default is argparse.SUPPRESS,
    so the namespace holds only what the command line gave (`layered` adds the other sources)."""
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for f, kind, section in _settings(*classes):
        default = _default(f)
        help_text = f.metadata["help"]
        if default not in (None, []):
            help_text += f" (default: {shown(f, default)})"
        names = [flag_of(f), *f.metadata["aliases"]]
        common = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        if kind is bool:
            groups[section].add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif f.metadata["repeat"]:
            groups[section].add_argument(*names, action="append", type=kind, metavar=_METAVARS.get(kind), **common)
        else:
            size = f.metadata["size"]
            groups[section].add_argument(*names, type=_size_arg if size else kind, metavar=_METAVARS.get("size" if size else kind),
                                         choices=f.metadata["choices"], **common)


def validate(config: Any) -> None:
    """Raise ValueError with a one-line reason naming the flag."""
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        reason = check(getattr(config, f.name)) if check else None
        if reason:
            raise ValueError(f"{flag_of(f)}: {reason}")


def from_args(cls: type, namespace: argparse.Namespace, **overrides: Any) -> Any:
    values = {}
    for f in dataclasses.fields(cls):
        if hasattr(namespace, f.name) and getattr(namespace, f.name) is not None:
            values[f.name] = getattr(namespace, f.name)
    values.update(overrides)
    config = cls(**values)
    validate(config)
    return config


@dataclass
class Layered:
    """Every value a source gave (as `from_args` reads it), where each came from, and the notices to print."""

    namespace: argparse.Namespace
    sources: dict[str, str] = field(default_factory=dict)  # field name -> "flag", "env KVFORK_X" or "file PATH"
    notices: list[str] = field(default_factory=list)  # a flag overriding an environment variable that differs


def _given(f: dataclasses.Field, raw: Any) -> str:
    """A value a user gave, as an error quotes it: a secret's never (its type alone), so no log line or
    terminal shows a key that was written in the wrong place or shape."""
    return f"a {type(raw).__name__} (a secret: not shown)" if f.metadata["secret"] else repr(raw)


def _scalar(f: dataclasses.Field, kind: type, raw: Any, where: str) -> Any:
    """One value from the environment (text) or a TOML file (text or TOML's types), as its flag reads it."""
    if kind is bool:
        word = str(raw).strip().lower() if not isinstance(raw, bool) else str(raw).lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected true or false, got {_given(f, raw)}")
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"{where}: expected {'a size' if f.metadata['size'] else kind.__name__}, got {_given(f, raw)}")
    try:
        value = parse_size(raw) if f.metadata["size"] and isinstance(raw, str) else kind(raw)
        if kind is int and isinstance(raw, float):
            raise ValueError
    except ValueError as e:
        size_text = f.metadata["size"] and isinstance(raw, str)
        reason = str(e) if size_text else f"expected {kind.__name__}, got {_given(f, raw)}"
        raise ValueError(f"{where}: {reason}") from None
    if f.metadata["choices"] and value not in f.metadata["choices"]:
        raise ValueError(f"{where}: {_given(f, value)} is not one of {', '.join(map(str, f.metadata['choices']))}")
    return value


def _convert(f: dataclasses.Field, kind: type, raw: Any, where: str) -> Any:
    if not f.metadata["repeat"]:
        return _scalar(f, kind, raw, where)
    items = [item.strip() for item in raw.split(",")] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise ValueError(f"{where}: expected a list, got {_given(f, raw)}")
    return [_scalar(f, kind, item, where) for item in items if item != ""]


def read_config_file(path: str, *classes: type) -> dict[str, Any]:
    """A TOML file's settings by field name; ValueError names the file and the key to change."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config: cannot read {path}: {e}") from None
    by_key = {}
    for f, kind, _ in _settings(*classes):
        for name in (flag_of(f), *f.metadata["aliases"]):
            by_key[name.lstrip("-")] = (f, kind)
    values = {}
    for key, raw in data.items():
        if key.replace("_", "-") not in by_key:
            near = difflib.get_close_matches(key.replace("_", "-"), by_key, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else " (keys are the serve flags without their dashes)"
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}")
        f, kind = by_key[key.replace("_", "-")]
        values[f.name] = _convert(f, kind, raw, f"--config {path}: {key}")
    return values


def layered(given: argparse.Namespace, environ: Mapping[str, str], config_path: str | None,
            *classes: type) -> Layered:
    """The settings of `classes` from the flags `given` (parsed by add_arguments' parser), the environment,
    then the config file: the first that has a value wins. ValueError names a malformed one."""
    in_file = read_config_file(config_path, *classes) if config_path else {}
    out = Layered(argparse.Namespace())
    for f, kind, _ in _settings(*classes):
        env = env_name(f)
        from_env = _convert(f, kind, environ[env], env) if environ.get(env, "") != "" else None
        if hasattr(given, f.name):
            value, source = getattr(given, f.name), "flag"
            if from_env is not None and from_env != value:
                source = f"flag, over {env}"
                out.notices.append(f"{flag_of(f)} on the command line overrides {env} (a flag wins over the "
                                   "environment, which wins over --config)")
        elif from_env is not None:
            value, source = from_env, f"env {env}"
        elif f.name in in_file:
            value, source = in_file[f.name], f"file {config_path}"
        else:
            continue
        setattr(out.namespace, f.name, value)
        out.sources[f.name] = source
    return out


def without_secrets(environ: Mapping[str, str], *classes: type) -> dict[str, str]:
    """`environ` less the variables of the secret settings of `classes` (KVFORK_API_KEY ...): the environment of
    a child process that serves no request."""
    hidden = {env_name(f) for f, _, _ in _settings(*classes) if f.metadata["secret"]}
    return {k: v for k, v in environ.items() if k not in hidden}


def on_command_line(sources: dict[str, str], *classes: type) -> list[tuple[str, str]]:
    """The secrets a flag gave, where every local user reads them: (flag, its environment variable)."""
    return [(flag_of(f), env_name(f)) for f, _, _ in _settings(*classes)
            if f.metadata["secret"] and sources.get(f.name) == "flag"]


def _toml_value(f: dataclasses.Field, value: Any) -> str:
    if f.metadata["size"] and isinstance(value, int):
        units = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
        unit = next((u for u, scale in units if value and value % scale == 0), None)
        return f'"{value // _UNITS[unit.lower()]}{unit}"' if unit else str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(f, v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def describe(configs: list[Any], sources: dict[str, str]) -> str:
    """Every setting of the configs with its value and source, as a TOML file `--config` reads back
    (unset values and secrets as comments)."""
    lines, section = [], None
    values = {f.name: getattr(c, f.name) for c in configs for f in dataclasses.fields(c)}
    for f, _, group in _settings(*(type(c) for c in configs)):
        if group != section:
            lines.append(f"{chr(10) if lines else ''}# {group}")
            section = group
        key, value = flag_of(f).lstrip("-"), values[f.name]
        source = sources.get(f.name, "default")
        if value is None or (f.metadata["secret"] and value):
            text = f"# {key} = {shown(f, value) if value is not None else '(unset)'}"
        else:
            text = f"{key} = {_toml_value(f, value)}"
        lines.append(f"{text:<60} # {source}")
    return "\n".join(lines)
