"""The analyses' results as plain JSON: what `--json` prints is derived from their dataclasses.

A result is a dataclass, nested where its JSON nests. `plain` turns one into JSON values,
field by field in declaration order, with three marks:
  * a field whose value is OMITTED is left out (a key that only some traces have);
  * a field with metadata INLINE has its own keys merged into its parent's (the cost table's
    keys sit at the top of `report --json`);
  * a class's DERIVED names properties printed after its fields (counts computed from them).
`json_paths` lists the key paths a result class prints, from its type hints alone:
tests/test_json_docs.py checks docs/json.md against it, so a field added without a line
in the docs fails there.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, ClassVar, Protocol


class Omitted(Enum):
    OMITTED = "omitted"


OMITTED = Omitted.OMITTED
INLINE = {"json": "inline"}
# A path segment for a key chosen by the data (docs/json.md writes it `<name>`), and the
# end of a path whose value has no declared shape (the docs may name its keys or not).
KEY, OPAQUE = "<>", "*"


def plain(x: Any) -> Any:
    """A result (or any value holding results) as JSON values: dicts, lists and scalars."""
    if is_dataclass(x) and not isinstance(x, type):
        out: dict[str, Any] = {}
        for f in fields(x):
            v = getattr(x, f.name)
            if v is OMITTED:
                continue
            if f.metadata.get("json") == "inline":
                out.update(plain(v))
            else:
                out[f.name] = plain(v)
        for name in getattr(type(x), "DERIVED", ()):
            out[name] = plain(getattr(x, name))
        return out
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x


class JsonView(Protocol):
    """What reads a result or its JSON alike: a key as `--json` prints it."""

    def __getitem__(self, key: str, /) -> Any: ...


class JsonRecord:
    """A result that prints as JSON. `rec[key]` reads the key as `--json` prints it, so a
    script written against the JSON reads a result alike; the front ends read attributes."""

    __slots__ = ()
    DERIVED: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = plain(self)
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]


def json_paths(tp: Any, prefix: str = "") -> set[str]:
    """The key paths a value of type `tp` prints: `a.b` for key b in object a, `a[]` for the
    elements of list a, `<>` for a key chosen by the data, and a final `*` where the value's
    shape is not declared (a dict of Any)."""
    tp = _strip_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        out: set[str] = set()
        for f in fields(tp):
            if f.metadata.get("json") == "inline":
                out |= json_paths(hints[f.name], prefix)
            else:
                out |= json_paths(hints[f.name], _join(prefix, f.name))
        for name in getattr(tp, "DERIVED", ()):
            out |= json_paths(typing.get_type_hints(getattr(tp, name).fget)["return"], _join(prefix, name))
        return out or {prefix}
    if origin is dict:
        return {_join(prefix, OPAQUE)} if args[1] is Any else json_paths(args[1], _join(prefix, KEY))
    if origin in (list, tuple) and args and _has_keys(args[0]):
        return json_paths(args[0], prefix + "[]")
    if tp is Any:
        return {_join(prefix, OPAQUE)}
    return {prefix}


def _has_keys(tp: Any) -> bool:
    tp = _strip_optional(tp)
    return tp is Any or typing.get_origin(tp) is dict or (isinstance(tp, type) and is_dataclass(tp))


def _strip_optional(tp: Any) -> Any:
    """`X | None | Omitted` -> X (a key that may be null or left out has X's keys)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a not in (type(None), Omitted)]
        return rest[0] if len(rest) == 1 or not any(_has_keys(a) for a in rest) else Any
    return tp


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
