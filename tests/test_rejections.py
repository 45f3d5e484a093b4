"""Requests the engine refuses (a prompt over the KV pool or the model's context, an output
budget past the context): each is a `rejected` request with its reason, the run goes on with
the others, and a run whose every request was refused says why in one line and exits 2."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import mstrace, one_line_error


def test_prompt_longer_than_kv_capacity_is_rejected_and_run_continues(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "big", "input_ids": list(range(5, 105)), "max_new_tokens": 2}) + "\n"
                  + json.dumps({"id": "ok", "input_ids": [5, 6, 7], "max_new_tokens": 2}) + "\n")
    out = tmp_path / "o"
    p = mstrace("run", "--model", "tiny", "--workload", str(wl), "--kv-blocks", "4", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    from tracing.reader import read_table

    req = read_table(out, "requests").to_pydict()
    got = dict(zip(req["request_id"], req["finish_reason"], strict=True))
    assert got == {"big": "rejected", "ok": "length"}
    detail = req["finish_detail"][req["request_id"].index("big")]
    assert "100 tokens" in detail and "KV pool has 4" in detail


@pytest.mark.parametrize("kind", ["pool", "max_new_tokens"])
def test_a_run_whose_every_request_is_rejected_says_why_and_fails(tmp_path, kind):
    out = tmp_path / "o"
    # float32, the checkpoint's: on an AMX CPU auto's note that it runs in bfloat16 is a line too
    f32 = ("--dtype", "float32")
    if kind == "pool":
        p = mstrace("run", "--model", "tiny", "--requests", "4", "--kv-blocks", "1", *f32, "--out", str(out), "-q")
    else:
        wl = tmp_path / "w.jsonl"
        wl.write_text(json.dumps({"input_ids": [5, 6, 7], "max_new_tokens": 10**9}) + "\n")
        p = mstrace("run", "--model", "tiny", "--workload", str(wl), *f32, "--out", str(out), "-q")
    assert p.returncode == 2
    line = one_line_error(p)
    assert "every request was rejected" in line
    assert ("the KV pool has" if kind == "pool" else "exceeds the model's context") in line
    assert (out / "meta.json").exists()  # the run happened: its trace stays


def test_mode_all_says_what_a_single_mode_says(tmp_path):
    """--mode all took none of a single run's endings: a workload whose every request was
    rejected exited 0 without a word, and a run that failed was a traceback, exit 1."""
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"input_ids": [5, 6, 7], "max_new_tokens": 10**9}) + "\n")
    f32 = ("--dtype", "float32")  # (auto's bfloat16 note is a line too on an AMX CPU)
    p = mstrace("run", "--model", "tiny", "--workload", str(wl), "--mode", "all", *f32, "--out", str(tmp_path / "a"),
                "-q")
    assert p.returncode == 2 and "every request was rejected" in one_line_error(p)
    late = tmp_path / "late.jsonl"  # an arrival the run cannot wait for: the run fails, one line
    late.write_text(json.dumps({"input_ids": [5, 6, 7], "max_new_tokens": 2, "arrival_s": 1e300}) + "\n")
    p = mstrace("run", "--model", "tiny", "--workload", str(late), "--mode", "all", *f32, "--out",
                str(tmp_path / "b"), "-q", timeout=180)
    assert p.returncode in (2, 4) and "Traceback" not in p.stderr, p.stderr
    one_line_error(p)


def test_rejections_are_counted_on_stderr_when_others_ran(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "big", "input_ids": list(range(5, 205)), "max_new_tokens": 2}) + "\n"
                  + json.dumps({"id": "ok", "input_ids": [5, 6, 7], "max_new_tokens": 2}) + "\n")
    p = mstrace("run", "--model", "tiny", "--workload", str(wl), "--kv-blocks", "8", "--out", str(tmp_path / "o"), "-q")
    assert p.returncode == 0, p.stderr
    assert '1 of 2 requests rejected: 1 like "prompt of 200 tokens needs 13 blocks' in p.stderr


def test_a_request_longer_than_the_models_context_is_rejected(tmp_path):
    from tests.support.checkpoints import build_llama

    ckpt = build_llama(tmp_path / "short", max_position_embeddings=64)
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "long", "input_ids": list(range(5, 65)), "max_new_tokens": 8}) + "\n"
                  + json.dumps({"id": "ok", "input_ids": [5, 6, 7], "max_new_tokens": 2}) + "\n")
    out = tmp_path / "o"
    p = mstrace("run", "--model", str(ckpt), "--workload", str(wl), "--out", str(out), "-q", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "exceeds the model's context of 64" in p.stderr
    from tracing.reader import read_table

    req = read_table(out, "requests", ["request_id", "finish_reason"]).to_pydict()
    assert dict(zip(req["request_id"], req["finish_reason"], strict=True)) == {"long": "rejected", "ok": "length"}


def test_a_rejected_request_is_in_no_e2e_the_report_sql_and_html_give(tmp_path):
    """E2E is over the requests served, in every view (one number, one meaning): a rejected
    request's arrival-to-finish is its refusal, not a latency (`top` masks it alike)."""
    import pyarrow as pa

    from tracing.reader import read_table
    from viewer.analysis.report import build_report
    from viewer.export.html_charts import ChartInputs, latency_cdfs
    from viewer.export.sql import TraceDb

    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps({"id": f"r{i}", "input_ids": list(range(5, 205 if i == 0 else 12)),
                                        "max_new_tokens": 4}) for i in range(4)) + "\n")
    out = tmp_path / "o"
    assert mstrace("run", "--model", "tiny", "--workload", str(wl), "--kv-blocks", "8", "--out", str(out),
                   "-q").returncode == 0
    req = read_table(out, "requests")
    assert req.num_rows == 4 and req["finish_reason"].to_pylist().count("rejected") == 1
    rep = build_report(out)["latency"]["e2e_ms"]
    sql = TraceDb(out).query("SELECT COUNT(e2e_ms), quantile_cont(e2e_ms, 0.5) FROM request_latency").rows[0]
    assert rep["count"] == sql[0] == 3 and sql[1] == pytest.approx(rep["p50"], rel=1e-9)
    fig = latency_cdfs([("", ChartInputs(pa.table({"ts_ns": pa.array([], pa.int64())}), pa.table({}), req))])
    e2e = [t for t in fig.data if t.xaxis == "x3"][0]
    assert len(e2e.x) == 3
