"""Bad input: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.cli import mstrace, one_line_error
from tests.support.tiny_runs import TinyRuns


def test_missing_model_folder(tmp_path):
    line = one_line_error(mstrace("run", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")))
    assert "model folder not found" in line


def test_unsupported_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    line = one_line_error(mstrace("run", "--model", str(d), "--out", str(tmp_path / "o")))
    assert "GPT2LMHeadModel" in line


def test_bad_workload_line(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "hello", "max_new_tokens": 4}\n{"prompt": "x", "max_new_tokens": -1}\n')
    line = one_line_error(mstrace("run", "--model", "tiny", "--workload", str(wl), "--out", str(tmp_path / "o")))
    assert "w.jsonl:2" in line and "max_new_tokens" in line
    assert not (tmp_path / "o").exists()  # nothing ran


@pytest.mark.parametrize("flag,value,needle", [
    ("--block-size", "0", "block-size"),
    ("--prefill-chunk", "0", "prefill-chunk"),
    ("--kv-bytes", "12 parsecs", "size"),
    ("--kv-bytes", "10", "smaller than one KV block"),
    ("--prompt-len", "9-3", "prompt-len"),
    # a NaN passes every `< 0` check; a negative rate used to mean "all at t=0" silently
    ("--rate", "-1", "--rate must be a finite number"),
    ("--rate", "nan", "--rate must be a finite number"),
    ("--wait-timeout", "nan", "--wait-timeout must be a finite number"),
    ("--prefill-stagger-us", "inf", "--prefill-stagger-us must be a finite number"),
    ("--debug-delay-ms", "bookkeeping=nan", "finite number of ms"),
])
def test_bad_flags(tmp_path, flag, value, needle):
    line = one_line_error(mstrace("run", "--model", "tiny", flag, value, "--out", str(tmp_path / "o")))
    assert needle in line
    assert not (tmp_path / "o").exists()  # no run started: nothing left behind


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("arrival_s", "Infinity"), ("top_p", "NaN")])
def test_non_finite_workload_numbers_are_refused(tmp_path, field, value):
    """Python's json reads NaN and Infinity: a NaN temperature used to run with every token 0."""
    wl = tmp_path / "w.jsonl"
    wl.write_text(f'{{"prompt": "hi", "max_new_tokens": 4, "{field}": {value}}}\n')
    line = one_line_error(mstrace("run", "--model", "tiny", "--workload", str(wl), "--out", str(tmp_path / "o")))
    assert "w.jsonl:1" in line and field in line
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- issue 12, point 4
def test_a_folder_without_weights_is_one_line_and_leaves_nothing(tmp_path):
    from scheduler.model.presets import ensure_preset

    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(ensure_preset("tiny") / "config.json", d / "config.json")
    out = tmp_path / "o"
    line = one_line_error(mstrace("run", "--model", str(d), "--out", str(out), "-q"))
    assert "no *.safetensors weights" in line
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch without CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path):
    out = tmp_path / "o"
    p = mstrace("run", "--model", "tiny", "--device", "cuda", "--out", str(out), "-q")
    assert p.returncode == 2
    assert "--device cuda" in one_line_error(p)
    assert not out.exists()


def test_out_pointing_at_a_file_is_one_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    line = one_line_error(mstrace("run", "--model", "tiny", "--out", str(f), "-q"))
    assert "is a file" in line and f.read_text() == "x"


@pytest.mark.parametrize("flags,needle", [(["--kv-bytes", "1KiB"], "smaller than one KV block"),
                                          (["--tp", "3"], "not divisible by tp_size 3")])
def test_a_run_that_cannot_start_leaves_no_skeleton(tmp_path, flags, needle):
    """The engine fails while starting: one line, and the same --out works next time."""
    out = tmp_path / "o"
    p = mstrace("run", "--model", "tiny", "--requests", "2", *flags, "--out", str(out), "-q", timeout=180)
    assert needle in one_line_error(p)
    assert not out.exists()
    p = mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr


def test_force_replaces_a_trace_and_only_a_trace(tmp_path):
    out = tmp_path / "o"
    assert mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(out), "-q").returncode == 0
    line = one_line_error(mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(out), "-q"))
    assert "not empty" in line and "--force" in line
    before = (out / "meta.json").read_text()
    p = mstrace("run", "--model", "tiny", "--requests", "3", "--out", str(out), "-q", "--force")
    assert p.returncode == 0, p.stderr
    assert (out / "meta.json").read_text() != before
    other = tmp_path / "notatrace"
    other.mkdir()
    (other / "thesis.tex").write_text("keep me")
    line = one_line_error(mstrace("run", "--model", "tiny", "--out", str(other), "-q", "--force"))
    assert "holds other files" in line and (other / "thesis.tex").read_text() == "keep me"


def test_force_never_removes_a_trace_it_would_not_replace(tmp_path):
    """--force removed a trace before the workload was checked (a bad line cost the old
    trace), a folder of other runs' traces (every one), and a trace a running mstrace was
    still writing (the two writers then corrupted each other): each is kept, one line."""
    from tracing.writer import TraceWriter

    out = tmp_path / "o"
    assert mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(out), "-q").returncode == 0
    before = (out / "meta.json").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    one_line_error(mstrace("run", "--model", "tiny", "--workload", str(bad), "--out", str(out), "-q", "--force"))
    assert (out / "meta.json").read_text() == before
    runs = tmp_path / "runs"
    (runs / "run-a").mkdir(parents=True)
    (runs / "run-b").mkdir()
    for r in ("run-a", "run-b"):
        (runs / r / "meta.json").write_text("{}")
    line = one_line_error(mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(runs), "-q", "--force"))
    assert "holds other files" in line and (runs / "run-a" / "meta.json").exists()
    w = TraceWriter(out)  # a run still writing it: its writer holds the trace's lock
    try:
        line = one_line_error(mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(out), "-q",
                                      "--force"))
        assert "being written by a running mstrace" in line and (out / "meta.json").read_text() == before
    finally:
        w.close()


# ---------------------------------------------------------------- issue 12, point 8
def test_leaks_cannot_judge_a_trace_without_probes(tiny_runs: TinyRuns):
    out = tiny_runs("--requests", "16", "-q", "--no-probes").out  # test_diff's np trace
    line = one_line_error(mstrace("leaks", str(out)))
    assert "--no-probes" in line and "cannot be known" in line


def test_report_on_a_folder_of_traces_names_them(tiny_runs: TinyRuns):
    out = tiny_runs("--requests", "24", "--mode", "all", "-q").out  # test_cli_width's modes
    line = one_line_error(mstrace("report", str(out)))
    assert all(str(out / m) in line for m in ("serial", "timeslice", "overlap"))


def test_version():
    p = mstrace("--version")
    assert p.returncode == 0 and p.stdout.startswith("mstrace ")


# ---------------------------------------------------------------- issue 12, point 1
def test_prompts_for_a_model_without_tokenizer_are_refused_up_front(tmp_path):
    from tests.support.checkpoints import build_llama

    ckpt = build_llama(tmp_path / "ckpt")
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"input_ids": [5, 6], "max_new_tokens": 2}\n{"prompt": "hello", "max_new_tokens": 2}\n')
    out = tmp_path / "o"
    p = mstrace("run", "--model", str(ckpt), "--workload", str(wl), "--out", str(out), "-q", timeout=120)
    assert p.returncode == 2
    line = one_line_error(p)
    assert "w.jsonl:2" in line and "tokenizer" in line
    assert not out.exists()


# ---------------------------------------------------------------- issue 12, point 5
def test_overlap_with_tp_is_refused_not_relabelled(tmp_path):
    out = tmp_path / "o"
    line = one_line_error(mstrace("run", "--model", "tiny", "--tp", "2", "--mode", "overlap", "--out", str(out), "-q"))
    assert "--mode overlap" in line and "--mode serial or timeslice" in line
    assert not out.exists()


# ---------------------------------------------------------------- issue 12, point 7
def test_progress_never_goes_into_a_pipe(tmp_path):
    p = mstrace("run", "--model", "tiny", "--requests", "4", "--out", str(tmp_path / "o"))  # no -q
    assert p.returncode == 0, p.stderr
    for stream in (p.stdout, p.stderr):
        assert "serial run" not in stream  # the progress bar's label


def test_the_live_views_child_run_is_not_live_whatever_the_config_file_says(tmp_path):
    """`run --live` runs the workload in a child without a terminal: a --config file's
    `live = true` made the child go live too, and fail ("stdout is not one")."""
    from viewer.commands.live_run import child_argv

    conf = tmp_path / "c.toml"
    conf.write_text("live = true\nforce = true\n")
    argv = child_argv(["mstrace", "run", "--config", str(conf), "--model", "tiny", "--requests", "2", "--live"],
                      tmp_path / "o")
    p = mstrace(*argv, timeout=180)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "o" / "meta.json").exists()
