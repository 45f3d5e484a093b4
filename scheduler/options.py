"""Run options declared once: a dataclass field carries its default, help text,
help panel and how its command-line or TOML value becomes the field's value.

`EngineConfig` (scheduler/config.py) and `RunOptions` (scheduler/harness/run_options.py)
declare their fields with `option(...)`; `mstrace run`'s flags (viewer/commands/flags.py),
`--config FILE.toml`, the validation messages and meta.json's config record are
all derived from those fields, so a default cannot differ between them.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

# `mstrace run --help` and `serve --help` group their flags into these panels, in this order.
WORKLOAD, SERVER, SCHEDULING, MEMORY, DEVICE, PARALLEL, FAULTS, OUTPUT = (
    "Workload", "Server", "Scheduling", "Memory", "Model and device", "Parallel", "Faults and debugging", "Output")
PANELS = (WORKLOAD, SERVER, SCHEDULING, MEMORY, DEVICE, PARALLEL, FAULTS, OUTPUT)


_SAME = "<the field's default>"  # Opt.cli_default when the flag's default is the field's


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class Opt:
    help: str
    panel: str
    flag: str | None = None  # the flag without "--"; default: the field's name with dashes
    # The flag's own value type when it is not the field's (a size with units, "on"/"off"),
    # its default as shown and parsed, and the conversion to the field's value (which also
    # receives TOML's native values).
    cli_type: Any = None
    cli_default: Any = _SAME
    parse: Callable[[Any], Any] | None = None
    short: str | None = None
    hidden: bool = False  # test-only options: accepted, not listed


def option(default: Any, help: str, panel: str, **kw: Any) -> Any:
    """A dataclass field declared as a run option (see `Opt`)."""
    return dataclasses.field(default=default, metadata={"opt": Opt(help, panel, **kw)})


@dataclass(frozen=True, slots=True)
class OptionField:
    name: str  # the dataclass field, also the TOML key
    type: Any  # the field's resolved type
    default: Any
    opt: Opt

    @property
    def flag(self) -> str:
        return "--" + (self.opt.flag or self.name.replace("_", "-"))

    @property
    def cli_type(self) -> Any:
        if self.opt.cli_type is not None:
            return self.opt.cli_type
        if typing.get_origin(self.type) is tuple:  # repeatable flag
            return list[str] | None
        return self.type

    @property
    def cli_default(self) -> Any:
        if self.opt.cli_default is not _SAME:
            return self.opt.cli_default
        return None if typing.get_origin(self.type) is tuple else self.default

    def to_value(self, v: Any) -> Any:
        """A flag's or a TOML key's value as the field holds it."""
        if self.opt.parse is not None:
            return self.opt.parse(v)
        if typing.get_origin(self.type) is tuple:
            return tuple(v or ())
        return v


@cache
def option_fields(cls: type) -> tuple[OptionField, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(OptionField(f.name, hints[f.name], f.default, f.metadata["opt"])
                 for f in dataclasses.fields(cls) if "opt" in f.metadata)


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of field `name`, for messages."""
    return next(f.flag for f in option_fields(cls) if f.name == name)


def _toml_kind(t: Any) -> tuple[tuple[type, ...], str]:
    """What a TOML value of a flag of type `t` may be: (python types, phrase)."""
    args = set(typing.get_args(t)) - {type(None)} or {t}
    if bool in args:
        return (bool,), "true or false"
    if int in args:
        return (int,), "an integer"
    if float in args:
        return (int, float), "a number"
    if list[str] in args or typing.get_origin(t) is list:
        return (list,), "a list of strings"
    return (str,), "a string"


def read_toml(path: str, classes: tuple[type, ...]) -> dict[str, Any]:
    """`--config FILE.toml`: flat keys named like the fields of `classes`; returns
    {field name: value as a flag would carry it}. One-line ConfigError on anything wrong."""
    import tomllib

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: {path} not found") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: not valid TOML: {str(e).splitlines()[0]}") from None
    known = {f.name: f for c in classes for f in option_fields(c)}
    out: dict[str, Any] = {}
    for key, v in data.items():
        f = known.get(key)
        if f is None:
            hint = f" (flag {key!r} is named {key.replace('-', '_')!r} here)" if key.replace("-", "_") in known else ""
            raise ConfigError(f"--config {path}: unknown option {key!r}{hint}; keys are named like the "
                              f"config fields, e.g. prefill_chunk")
        kinds, phrase = _toml_kind(f.cli_type)
        if f.opt.parse is not None:  # its parser reads native values as well: let it judge
            kinds = (int, float, str, bool, list)
        ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
        if ok and isinstance(v, list) and f.opt.parse is None:
            ok = all(isinstance(x, str) for x in v)
        if not ok:
            raise ConfigError(f"--config {path}: {key} must be {phrase}, got {v!r}")
        out[key] = v
    return out
