"""`mstrace run`'s and `serve`'s flags, generated from the option fields of EngineConfig
and RunOptions or ServeOptions (scheduler/options.py), plus `--config FILE.toml`. A
field's help shows its bounds from the same declaration that checks them.

A value comes from, in order: the command line, the TOML file, the field's default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from scheduler.config import EngineConfig
from scheduler.harness.run_options import RunOptions
from scheduler.options import (
    PANELS,
    ConfigError,
    OptionField,
    flag_re,
    names_flag,
    option_fields,
    read_toml,
)

CLASSES = (EngineConfig, RunOptions)
CONFIG_HELP = ("TOML file of options: flat keys named like the config fields (prefill_chunk = 512, "
               "kv_bytes = \"256MiB\", inject = [\"leak\"]); flags given on the command line override it.")


def all_fields(classes: tuple[type, ...] = CLASSES) -> list[OptionField]:
    """Every option field, in help-panel order (typer lists panels as they first appear)."""
    return sorted((f for c in classes for f in option_fields(c)), key=lambda f: PANELS.index(f.opt.panel))


def _decls(f: OptionField) -> list[str]:
    names = f.flag
    if f.cli_type in (bool, bool | None):
        names = f"{f.flag}/--no-{f.flag[2:]}"
    return [names, *([f.opt.short] if f.opt.short else [])]


def _parameter(f: OptionField) -> inspect.Parameter:
    text = f"{f.opt.help} [{', '.join(f.limits)}]" if f.limits else f.opt.help
    info = typer.Option(*_decls(f), help=text, rich_help_panel=f.opt.panel, hidden=f.opt.hidden)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.cli_default,
                             annotation=Annotated[f.cli_type, info])


def build(values: dict[str, Any], given: set[str], config: Path | None,
          classes: tuple[type, ...] = CLASSES, toml: dict[str, Any] | None = None) -> list[Any]:
    """One record per class from the parsed flags (`given`: those set on the command line)
    and the TOML file (`toml`: as read_toml read it, if it was). ConfigError (one line) on a
    bad value; a parser's message that names no flag is given the field's flag
    (`name_sources` turns it into the file's key)."""
    if toml is None:
        toml = read_toml(str(config), classes) if config is not None else {}
    records = []
    for cls in classes:
        kw = {}
        for f in option_fields(cls):
            v = values[f.name] if f.name in given or f.name not in toml else toml[f.name]
            try:
                kw[f.name] = f.to_value(v)
            except ConfigError as e:
                raise ConfigError(str(e) if names_flag(str(e), f.flag) else f"{f.flag}: {e}") from None
        records.append(cls(**kw))
    return records


def name_sources(msg: str, from_file: dict[str, str], config: Path | None) -> str:
    """A message about values names their flags ("--requests must be >= 1"); a value that
    came from the TOML file (`from_file`: {flag: key}) is named by the file and its key
    instead: "--config config.toml: requests must be >= 1". A flag not given is not named."""
    named = False
    for flag, key in from_file.items():
        msg, n = flag_re(flag).subn(key, msg)
        named = named or n > 0
    return f"--config {config}: {msg}" if named else msg


def run_command(body: Callable[..., None], fail: Callable[..., NoReturn], classes: tuple[type, ...] = CLASSES,
                doc: str = "Run a workload through the reference engine and write a trace.") -> Callable[..., None]:
    """A typer command whose parameters are every option field of `classes`, calling `body`
    with one record per class and `fail=`: `fail` naming a value from the --config file by
    the file and its key (`name_sources`)."""
    fields = all_fields(classes)

    def run(ctx: typer.Context, config: Path | None = None, **values: Any) -> None:
        given = {f.name for f in fields if (src := ctx.get_parameter_source(f.name)) is not None
                 and src.name not in ("DEFAULT", "DEFAULT_MAP")}
        from_file: dict[str, str] = {}

        def usage_error(msg: str, *code: int) -> NoReturn:
            # a usage error (no code given) about a value from the file names the file's key;
            # a stalled or failed run's message (exit 3, 4) is passed on as it is
            fail(msg if code else name_sources(msg, from_file, config), *code)

        try:
            toml = read_toml(str(config), classes) if config is not None else {}
            from_file.update({f.flag: f.name for f in fields if f.name in toml and f.name not in given})
            records = build(values, given, config, classes, toml)
        except ConfigError as e:
            usage_error(str(e))
        body(*records, fail=usage_error)

    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
              inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                annotation=Annotated[Path | None, typer.Option("--config", help=CONFIG_HELP)])]
    params += [_parameter(f) for f in fields]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__doc__ = doc
    return run


def click_command(body: Callable[..., None], fail: Callable[..., NoReturn], name: str = "run",
                  classes: tuple[type, ...] = CLASSES, doc: str | None = None) -> Any:
    """A generated command as a click command of its own, built only when it is asked for
    (viewer/cli.py)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name=name)(run_command(body, fail, classes, *([doc] if doc else [])))
    return typer.main.get_command(app)
