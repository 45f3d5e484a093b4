"""Which optional extra (pyproject's [project.optional-dependencies]) provides which module.

The base install reads traces; every other command needs an extra. A command checks its
extras before it starts (`require`), so a missing one costs the user one line and exit 2,
not a traceback after half a run. `for_module` is the same map read the other way, for a
missing module that no check foresaw (viewer/cli.py's `main`).
"""

from __future__ import annotations

import importlib.util

# extra -> the top-level modules it installs, as code here imports them. Longest dotted
# prefix wins in `for_module`, so `opentelemetry.exporter` is otlp's while the SDK is engine's.
MODULES: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "transformers", "tokenizers", "safetensors", "jinja2", "opentelemetry.sdk"),
    "serve": ("fastapi", "pydantic", "uvicorn", "httptools", "prometheus_client"),
    "tui": ("textual",),
    "sql": ("duckdb",),
    "html": ("plotly",),
    "perfetto": ("perfetto",),
    "otlp": ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.proto"),
    "import": ("ijson",),
    "bench": ("aiohttp",),
}
# Not checked up front: sentencepiece and protobuf are imported only for sentencepiece-only
# model folders (the tokenizer's fallback); uvloop only by uvicorn, where it exists.
_LATE: dict[str, str] = {"sentencepiece": "engine", "google.protobuf": "engine", "uvloop": "serve"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def missing(*extras: str) -> tuple[str, str] | None:
    """(extra, module) for the first module of `extras` that is not installed, else None."""
    for extra in extras:
        for module in MODULES[extra]:
            if not _installed(module):
                return extra, module
    return None


def message(what: str, extra: str, module: str) -> str:
    return (f"{what} needs {module}, which is not installed: install mstrace[{extra}] "
            f"(pip install 'mstrace[{extra}]')")


def for_module(name: str | None) -> str | None:
    """The extra that provides the module `name` (a ModuleNotFoundError's), if any does."""
    if not name:
        return None
    owners = {m: e for e, ms in MODULES.items() for m in ms} | _LATE
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        extra = owners.get(".".join(parts[:n]))
        if extra is not None:
            return extra
    # a parent of a mapped module: `opentelemetry` itself is missing when the SDK is
    return next((e for m, e in owners.items() if m.startswith(name + ".")), None)
