"""One source of run options: `mstrace run`'s flags, --config FILE.toml, meta.json's
config record and the validation all come from the EngineConfig / RunOptions /
ServeOptions fields."""

from __future__ import annotations

import json
import math
import typing
from dataclasses import fields, replace
from typing import Any

import pytest
import typer

from scheduler.config import EngineConfig
from scheduler.harness.run_options import RunOptions
from scheduler.options import ConfigError, OptionField, option_fields
from scheduler.serving.options import ServeOptions
from tests.support.cli import mstrace, one_line_error
from viewer.cli import app
from viewer.commands.flags import all_fields, build


def _run_params() -> dict[str, object]:
    group = typer.main.get_command(app)
    run = group.get_command(typer.Context(group), "run")  # type: ignore[attr-defined]
    return {p.name: p for p in run.params}


def test_every_flag_has_its_fields_default():
    params = _run_params()
    by_name = {f.name: f for f in all_fields()}
    declared = {f.name for c in (EngineConfig, RunOptions) for f in fields(c)}
    assert set(by_name) == declared  # every field is a flag ...
    assert set(params) - {"config", "help"} == declared  # ... and every flag a field
    for name, f in by_name.items():
        p = params[name]
        assert f.to_value(p.default) == f.default, name
        assert f.flag in p.opts, (name, p.opts)
    # all flags at their defaults give exactly the default records
    cfg, opts = build({n: p.default for n, p in params.items()}, set(), None)
    assert cfg == EngineConfig() and opts == RunOptions()


def test_help_groups_flags_into_panels():
    p = mstrace("run", "--help")
    assert p.returncode == 0
    panels = [ln.split("─ ")[1].split(" ─")[0] for ln in p.stdout.splitlines() if ln.startswith("╭─ ")]
    assert panels == ["Options", "Workload", "Scheduling", "Memory", "Model and device", "Parallel",
                      "Faults and debugging", "Output"]
    assert "--debug-delay-ms" not in p.stdout  # test-only flags are accepted, not listed


FLAGS = ["--model", "tiny", "--requests", "3", "--prompt-len", "8-24", "--output-len", "4-6", "--seed", "7",
         "--prefill-chunk", "64", "--no-prefix-sharing", "--kv-bytes", "4MiB", "--comm-overlap", "off",
         "--inject", "slow-sender", "--wait-timeout", "7.5", "--snapshot-every", "3", "--cpu-device", "thread",
         "--no-split-streams", "-q"]
TOML = """
model = "tiny"
requests = 3
prompt_len = [8, 24]
output_len = "4-6"
seed = 7
prefill_chunk = 64
enable_prefix_sharing = false
kv_bytes = 4194304
comm_overlap = false
inject = ["slow-sender"]
wait_timeout_s = 7.5
snapshot_every = 3
cpu_device = "thread"
split_streams = false
quiet = true
"""


def test_config_file_gives_the_same_run_as_the_flags(tmp_path):
    a, b, c = tmp_path / "flags", tmp_path / "toml", tmp_path / "override"
    p = mstrace("run", *FLAGS, "--out", str(a))
    assert p.returncode == 0, p.stderr
    cfg = tmp_path / "run.toml"
    cfg.write_text(TOML)
    p = mstrace("run", "--config", str(cfg), "--out", str(b))
    assert p.returncode == 0, p.stderr
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert meta_a["config"] == meta_b["config"]
    assert meta_a["workload"] == meta_b["workload"]  # same synthetic spec, same seed: same requests
    assert meta_a["config"]["kv_bytes"] == 4 << 20 and meta_a["config"]["comm_overlap"] is False
    # a flag on the command line wins over the file
    p = mstrace("run", "--config", str(cfg), "--prefill-chunk", "32", "--out", str(c))
    assert p.returncode == 0, p.stderr
    meta_c = json.loads((c / "meta.json").read_text())["config"]
    assert meta_c["prefill_chunk"] == 32
    assert {k: v for k, v in meta_c.items() if k != "prefill_chunk"} == \
        {k: v for k, v in meta_b["config"].items() if k != "prefill_chunk"}


@pytest.mark.parametrize("text,needle", [
    ("prefill_chunk = \"abc\"\n", "prefill_chunk must be an integer"),
    ("prefill-chunk = 64\n", "unknown option 'prefill-chunk'"),
    ("no_such_option = 1\n", "unknown option 'no_such_option'"),
    ("prefill_chunk = \n", "not valid TOML"),
    ("comm_overlap = \"maybe\"\n", "bad.toml: comm_overlap must be on or off"),
    ("prompt_len = [3]\n", "bad.toml: prompt_len must look like"),
    ("enable_prefix_sharing = 1\n", "must be true or false"),
    ("inject = [\"leak\", 3]\n", "must be a list of strings"),
])
def test_bad_config_file(tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    line = one_line_error(mstrace("run", "--config", str(cfg), "--out", str(tmp_path / "o")))
    assert needle in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command,text,says", [
    # checked when the workload is made, after the model's config is read
    ("run", "requests = 0\n", "requests must be >= 1"),
    # checked by EngineConfig.validate
    ("run", "block_size = 0\n", "block_size must be >= 1 (got 0)"),
    ("run", "rate = -1.0\n", "rate must be a finite number"),
    # a parser's message that names no flag of its own
    ("run", "kv_bytes = \"12 parsecs\"\n", "kv_bytes: cannot read size '12 parsecs'"),
    ("serve", "port = 70000\n", "port must be in 0..65535, got 70000"),
])
def test_a_bad_value_from_the_config_file_names_the_file_and_key(tmp_path, command, text, says):
    """Not `--requests must be >= 1`: no --requests was given. The file and its key are
    named, with the usual one line and exit 2."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("model = \"tiny\"\n" + text)
    p = mstrace(command, "--config", str(cfg), "--out", str(tmp_path / "o"), timeout=120)
    line = one_line_error(p)
    assert p.returncode == 2
    assert line.startswith(f"error: --config {cfg}: {says}"), line
    assert not (tmp_path / "o").exists()


def test_a_bad_value_from_a_flag_still_names_the_flag(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("model = \"tiny\"\nrequests = 8\nblock_size = 0\n")
    p = mstrace("run", "--config", str(cfg), "--block-size", "16", "--requests", "0", "--out", str(tmp_path / "o"))
    assert one_line_error(p) == "error: --requests must be >= 1" and p.returncode == 2
    p = mstrace("run", "--model", "tiny", "--kv-bytes", "12 parsecs", "--out", str(tmp_path / "o"))
    assert one_line_error(p).startswith("error: --kv-bytes: cannot read size '12 parsecs'")


def test_missing_config_file(tmp_path):
    line = one_line_error(mstrace("run", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")))
    assert "not found" in line


# ---------------------------------------------------------------- issue 26, point 5
GROUPS = (EngineConfig, RunOptions, ServeOptions)
UNBOUNDED = {"seed"}  # numbers that may take any value


def _is_float(f: OptionField) -> bool:
    return float in (typing.get_args(f.type) or (f.type,))


def _is_number(f: OptionField) -> bool:
    types = set(typing.get_args(f.type) if typing.get_origin(f.type) is not tuple else ()) or {f.type}
    return types - {type(None)} <= {int, float}


def _declared(kind: str) -> list[Any]:
    """(group, field) of every field with a declared constraint of `kind`."""
    out = []
    for cls in GROUPS:
        for f in option_fields(cls):
            has = {"bounds": bool(f.limits), "choices": f.opt.choices is not None,
                   "finite": _is_float(f) and f.opt.finite}[kind]
            if has:
                out.append(pytest.param(cls, f, id=f"{cls.__name__}.{f.name}"))
    return out


def _refused(record: Any, f: OptionField, value: Any) -> str:
    with pytest.raises(ConfigError) as e:
        replace(record, **{f.name: value}).validate()
    msg = str(e.value)
    assert f.flag in msg and "\n" not in msg, msg
    return msg


def test_every_number_declares_its_range():
    """A new numeric field says what it accepts (and is then covered by the tests below)."""
    for cls in GROUPS:
        for f in option_fields(cls):
            if _is_number(f) and f.name not in UNBOUNDED:
                assert f.limits or f.opt.choices is not None, f"{cls.__name__}.{f.name} declares no bounds"


@pytest.mark.parametrize("cls,f", _declared("bounds"))
def test_a_value_past_a_bound_is_refused_and_the_bound_itself_is_not(cls, f):
    step = 0.5 if _is_float(f) else 1
    o = f.opt
    outside = [b for b in (None if o.ge is None else o.ge - step, o.gt, None if o.le is None else o.le + step, o.lt)
               if b is not None]
    for v in outside:
        v = float(v) if _is_float(f) else int(v)
        msg = _refused(cls(), f, v)
        assert f.bounds in msg or "0..65535" in msg, msg
    for v in (o.ge, o.le):  # inclusive bounds are allowed
        if v is not None:
            replace(cls(), **{f.name: v}).validate()


@pytest.mark.parametrize("cls,f", _declared("finite"))
def test_a_float_field_refuses_nan_and_inf(cls, f):
    for v in (math.nan, math.inf, -math.inf):
        assert "finite number" in _refused(cls(), f, v)


@pytest.mark.parametrize("cls,f", _declared("choices"))
def test_a_value_outside_the_choices_is_refused_naming_them(cls, f):
    choices = f.opt.choices
    bad = "no-such-choice" if isinstance(choices[0], str) else max(choices) + 1
    msg = _refused(cls(), f, bad)
    assert all(str(c) in msg for c in choices), msg
    for v in choices:
        replace(cls(), **{f.name: v}).validate()


def test_a_field_of_the_wrong_type_is_refused_not_a_traceback():
    _refused(EngineConfig(), next(f for f in option_fields(EngineConfig) if f.name == "block_size"), "16")
    _refused(RunOptions(), next(f for f in option_fields(RunOptions) if f.name == "rate"), True)


@pytest.mark.parametrize("kw,says", [
    ({"prompt_len": (9, 3)}, "--prompt-len must satisfy 1 <= min <= max"),
    ({"output_len": (0, 4)}, "--output-len must satisfy 1 <= min <= max"),
    ({"inject": ("nope",)}, "--inject: unknown fault 'nope'"),
    ({"debug_delay_ms": (("nowhere", 1.0),)}, "--debug-delay-ms: unknown place"),
    ({"debug_delay_ms": (("bookkeeping", -1.0),)}, "negative delay"),
])
def test_a_fields_own_check_says_what_bounds_cannot(kw, says):
    """Tuples: the field's `check` (its items), not bounds."""
    record = RunOptions() if "prompt_len" in kw or "output_len" in kw else EngineConfig()
    with pytest.raises(ConfigError, match=says):
        replace(record, **kw).validate()


@pytest.mark.parametrize("kw,says", [
    ({"kv_blocks": 8, "kv_bytes": 1 << 20}, "in blocks or in bytes, not both"),
    ({"inject": ("deadlock",)}, "--inject deadlock needs split streams"),
    ({"inject": ("deadlock",), "mode": "overlap", "split_streams": False}, "--inject deadlock needs split streams"),
    ({"inject": ("stall-rank",)}, "--inject stall-rank needs more than one rank"),
    ({"cpu_device": "process", "debug_kv_check": True}, "use --cpu-device thread"),
    ({"cpu_device": "process", "pp": 2}, "use --cpu-device thread"),
    ({"tp": 2, "mode": "overlap"}, "--mode overlap needs overlap scheduling.*use --mode serial or timeslice"),
    ({"pp": 2, "mode": "overlap", "split_streams": False}, "--mode overlap needs overlap scheduling"),
    ({"tp": 2, "overlap_schedule": True}, "--overlap-schedule and --split-streams cannot be used with --tp/--pp"),
    ({"pp": 2, "split_streams": True}, "--overlap-schedule and --split-streams cannot be used with --tp/--pp"),
    ({"tp": 2, "kv_layout": "contiguous"}, "--kv-layout contiguous cannot be used with --tp/--pp"),
])
def test_cross_field_rules(kw, says):
    with pytest.raises(ConfigError, match=says):
        EngineConfig(**kw).validate()


@pytest.mark.parametrize("kw", [
    {"kv_blocks": 8}, {"kv_bytes": 1 << 20},
    {"inject": ("deadlock",), "mode": "overlap"},
    {"inject": ("stall-rank",), "tp": 2},
    {"cpu_device": "thread", "debug_kv_check": True, "tp": 2},
    {"tp": 2, "mode": "timeslice"},
    {"kv_layout": "contiguous"},
    {"tp": 2, "pp": 2, "mode": "overlap", "overlap_schedule": False, "split_streams": False},
])
def test_cross_field_rules_let_their_neighbours_pass(kw):
    EngineConfig(**kw).validate()


def test_the_defaults_are_valid():
    for cls in GROUPS:
        cls().validate()


def test_help_shows_the_declared_bounds():
    params = _run_params()
    assert params["block_size"].help.endswith("[>= 1]")
    assert params["watermark_frac"].help.endswith("[>= 0, < 1]")
    assert params["wait_timeout_s"].help.endswith("[> 0, <= 604800]")
    assert not params["seed"].help.endswith("]")


@pytest.mark.parametrize("command,flags,says", [
    # the TP/overlap rule is EngineConfig's; run checks every mode that --mode all runs
    ("run", ["--tp", "2", "--mode", "all"], "error: --mode all runs overlap too: --mode overlap needs"),
    ("run", ["--tp", "2", "--overlap-schedule"], "error: --overlap-schedule and --split-streams cannot be used"),
    ("run", ["--workload", "w.jsonl", "--shared-prefix", "2"], "error: --shared-prefix must be a finite number in"),
    ("serve", ["--send-buffer-bytes", "-1"], "error: --send-buffer-bytes must be >= 0 (got -1)"),
    ("serve", ["--shutdown-timeout-s", "inf"], "error: --shutdown-timeout-s must be a finite number >= 0"),
])
def test_a_declared_rule_broken_on_the_command_line_is_one_line(tmp_path, command, flags, says):
    p = mstrace(command, "--model", "tiny", *flags, "--out", str(tmp_path / "o"), timeout=120)
    line = one_line_error(p)
    assert p.returncode == 2 and line.startswith(says), line
    assert not (tmp_path / "o").exists()


def test_a_length_in_a_config_file_may_be_one_integer():
    """`prompt_len = 64` in TOML is 64-64, as the flag's "64" is (it was refused: "must look
    like 16-512 or 64, got 64"); true is not a length."""
    from scheduler.harness.run_options import _length_range

    parse = _length_range("prompt_len")
    assert parse(64) == parse("64") == (64, 64) and parse([8, 24]) == (8, 24)
    with pytest.raises(ConfigError):
        parse(True)
