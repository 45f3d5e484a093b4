"""Options declared once: a dataclass field carries its default, help text, help panel,
how its command-line or TOML value becomes the field's value, and what a value must be
(choices, bounds, finite), so one validator (`check_fields`) checks every field.

The option groups, one module each:
- `EngineConfig`: the engine (scheduler/config.py), with the few rules between its fields;
- `RunOptions`: what `mstrace run` adds (scheduler/harness/run_options.py);
- `ServeOptions`: what `mstrace serve` adds (scheduler/serving/options.py).
`mstrace run`'s and `serve`'s flags (viewer/commands/flags.py), `--config FILE.toml`, the
validation messages and meta.json's config record are all derived from those fields, so
a default or a bound cannot differ between them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
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
    # What a value must be (None, where the type allows it, is always allowed): one of
    # `choices`; within the bounds (ge: >=, gt: >, le: <=, lt: <); a float field also
    # finite unless finite=False (a NaN passes every `< 0` test). `check` says what the
    # others cannot (a tuple's items, say): it raises ValueError with one line.
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True
    check: Callable[[Any], Any] | None = None
    # The refusal's own wording ("{flag}", "{rule}", "{value}") where the generic
    # "{flag} must be {rule} (got {value!r})" will not do.
    refusal: str | None = None


def option(default: Any, help: str, panel: str, **kw: Any) -> Any:
    """A dataclass field declared as an option (see `Opt`)."""
    return dataclasses.field(default=default, metadata={"opt": Opt(help, panel, **kw)})


def _either(choices: tuple[Any, ...]) -> str:
    """("a", "b", "c") -> "a, b or c"."""
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


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

    @property
    def limits(self) -> list[str]:
        """The bounds one by one, as --help shows them: [">= 0", "< 1"]."""
        o = self.opt
        return [f"{op} {b}" for op, b in ((">=", o.ge), (">", o.gt), ("<=", o.le), ("<", o.lt)) if b is not None]

    @property
    def bounds(self) -> str:
        """The bounds as a message says them: ">= 1", "> 0", "in [0, 1)"; "" if none."""
        o = self.opt
        if len(self.limits) < 2:
            return "".join(self.limits)
        lo = f"[{o.ge}" if o.ge is not None else f"({o.gt}"
        hi = f"{o.le}]" if o.le is not None else f"{o.lt})"
        return f"in {lo}, {hi}"

    @property
    def is_number(self) -> bool:
        """Bounded, or a float: its value must be a number."""
        return bool(self.bounds) or float in self._types

    @property
    def rule(self) -> str:
        """What a value must be, for messages: "auto, cpu or cuda", "a finite number >= 0"."""
        if self.opt.choices is not None:
            return _either(self.opt.choices)
        if float in self._types and self.opt.finite:
            return " ".join(("a finite number", self.bounds)).strip()
        return self.bounds or "a number"

    @property
    def _types(self) -> set[Any]:
        return set(typing.get_args(self.type)) or {self.type}

    def refusal_of(self, v: Any) -> str | None:
        """Why the field cannot hold `v`, in one line naming its flag; None if it can."""
        o = self.opt
        if v is None and type(None) in self._types:
            return None
        if o.check is not None:
            try:
                o.check(v)
            except ValueError as e:
                return str(e) if names_flag(str(e), self.flag) else f"{self.flag}: {e}"
        if self._allows(v):
            return None
        return (o.refusal or "{flag} must be {rule} (got {value!r})").format(flag=self.flag, rule=self.rule, value=v)

    def _allows(self, v: Any) -> bool:
        o = self.opt
        if o.choices is not None and v not in o.choices:
            return False
        if not self.is_number:
            return True
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        if isinstance(v, float) and o.finite and not math.isfinite(v):
            return False
        return ((o.ge is None or v >= o.ge) and (o.gt is None or v > o.gt)
                and (o.le is None or v <= o.le) and (o.lt is None or v < o.lt))

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


def check_fields(record: object) -> None:
    """Every option field of `record` against its own declaration (choices, bounds, finite,
    check): ConfigError naming the first field's flag that holds a value it cannot."""
    cls: type = type(record)
    for f in option_fields(cls):
        why = f.refusal_of(getattr(record, f.name))
        if why is not None:
            raise ConfigError(why)


def names_flag(msg: str, flag: str) -> bool:
    return flag_re(flag).search(msg) is not None


def flag_re(flag: str) -> re.Pattern[str]:
    """`flag` as a word of a message: not --no-flag, not --flag-more."""
    return re.compile(rf"(?<![\w-]){re.escape(flag)}(?![\w-])")


def parse_path(v: Any) -> Path | None:
    """A path flag's or TOML key's value."""
    if v is None or isinstance(v, Path):
        return v
    if not isinstance(v, str):
        raise ConfigError(f"a path must be a string, got {v!r}")
    return Path(v)


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
