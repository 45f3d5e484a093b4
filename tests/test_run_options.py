"""One source of run options: `mstrace run`'s flags, --config FILE.toml and meta.json's
config record all come from the EngineConfig / RunOptions fields."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import typer

from scheduler.config import EngineConfig
from scheduler.harness.run_options import RunOptions
from tests.support.cli import mstrace
from tests.test_cli_errors import one_line_error
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
