from __future__ import annotations

import json

import pytest

from scheduler.harness.workload import (
    SyntheticSpec,
    WorkloadError,
    load_workload,
    save_workload,
    synthetic_workload,
    workload_digest,
)


def write(tmp_path, lines):
    p = tmp_path / "w.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_valid_file_with_defaults(tmp_path):
    p = write(tmp_path, [{"prompt": "hi", "max_new_tokens": 3},
                         {"id": "x", "input_ids": [1, 2], "max_new_tokens": 2, "temperature": 0.7,
                          "top_p": 0.9, "ignore_eos": True, "arrival_s": 1.5, "seed": 3, "logprobs": 2,
                          "prompt_logprobs": 0}])
    a, b = load_workload(p)
    assert a.request_id == "req-0" and a.prompt == "hi" and a.params.temperature == 0.0 and a.params.top_p == 1.0
    assert a.params.logprobs is None and a.params.prompt_logprobs is None
    assert b.input_ids == (1, 2) and b.params.ignore_eos and b.arrival_s == 1.5 and b.params.seed == 3
    assert b.params.logprobs == 2 and b.params.prompt_logprobs == 0
    assert b.to_json()["logprobs"] == 2 and "logprobs" not in a.to_json()


@pytest.mark.parametrize("line,field", [
    ('{"prompt": "a"}', "max_new_tokens"),
    ('{"prompt": "a", "max_new_tokens": "5"}', "max_new_tokens"),
    ('{"prompt": "a", "max_new_tokens": 0}', "max_new_tokens"),
    ('{"prompt": "a", "max_new_tokens": true}', "max_new_tokens"),
    ('{"max_new_tokens": 2}', "prompt"),
    ('{"prompt": "a", "input_ids": [1], "max_new_tokens": 2}', "prompt"),
    ('{"input_ids": [1, -2], "max_new_tokens": 2}', "input_ids"),
    ('{"input_ids": [1, 999], "max_new_tokens": 2}', "input_ids"),
    ('{"prompt": "a", "max_new_tokens": 2, "top_p": 0}', "top_p"),
    ('{"prompt": "a", "max_new_tokens": 2, "temperature": -1}', "temperature"),
    ('{"prompt": "a", "max_new_tokens": 2, "arrival_s": -1}', "arrival_s"),
    ('{"prompt": "a", "max_new_tokens": 2, "bogus": 1}', "bogus"),
    ('{"prompt": "a", "max_new_tokens": 2, "ignore_eos": 1}', "ignore_eos"),
    ('{"prompt": "a", "max_new_tokens": 2, "logprobs": 21}', "logprobs"),
    ('{"prompt": "a", "max_new_tokens": 2, "prompt_logprobs": true}', "prompt_logprobs"),
])
def test_bad_line_names_line_and_field(tmp_path, line, field):
    p = write(tmp_path, ['{"prompt": "ok", "max_new_tokens": 1}', line])
    with pytest.raises(WorkloadError) as e:
        load_workload(p, vocab_size=100)
    msg = str(e.value)
    assert "w.jsonl:2" in msg and field in msg and "\n" not in msg


def test_invalid_json_and_duplicates(tmp_path):
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: not valid JSON"):
        load_workload(write(tmp_path, ["{nope"]))
    with pytest.raises(WorkloadError, match="duplicate"):
        load_workload(write(tmp_path, [{"id": "a", "prompt": "x", "max_new_tokens": 1}] * 2))
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(tmp_path / "missing.jsonl")


def test_synthetic_is_seeded_and_round_trips(tmp_path):
    spec = SyntheticSpec(requests=20, prompt_len=(5, 40), output_len=(2, 9), shared_prefix_frac=0.5,
                         shared_prefix_len=4, rate=10.0, seed=4)
    a = synthetic_workload(spec, 100, {0, 1})
    b = synthetic_workload(spec, 100, {0, 1})
    assert a == b and workload_digest(a) == workload_digest(b)
    assert all(5 <= len(i.input_ids) <= 40 and 0 not in i.input_ids and 1 not in i.input_ids for i in a)
    arrivals = [i.arrival_s for i in a]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    shared = [i for i in a if i.input_ids[:4] == a[0].input_ids[:4] or len(i.input_ids) <= 4]
    assert 3 <= len(shared) < len(a)
    p = tmp_path / "s.jsonl"
    save_workload(a, p)
    assert workload_digest(load_workload(p)) == workload_digest(a)


def test_lines_are_cut_at_newlines_only_and_bad_json_of_any_kind_is_one_line(tmp_path):
    """A prompt holding U+2028, U+2029 or U+0085 (json.dumps with ensure_ascii=False writes
    them as they are) is one line, as JSON Lines says (splitlines() cut it: "not valid
    JSON"); a BOM is not the first line's; CRLF ends are read; nesting too deep and an
    integer past Python's digit limit are "not valid JSON", not tracebacks."""
    import json

    rows = [{"id": f"r{i}", "prompt": f"a{c}b", "max_new_tokens": 1} for i, c in enumerate("\u2028\u2029\u0085")]
    p = tmp_path / "w.jsonl"
    p.write_text("\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    assert [it.prompt for it in load_workload(p)] == [r["prompt"] for r in rows]
    for bad in ("[" * 100_000 + "]" * 100_000, '{"id": "x", "max_new_tokens": ' + "9" * 5000 + "}"):
        p.write_text(json.dumps({"id": "ok", "prompt": "x", "max_new_tokens": 1}) + "\n" + bad + "\n")
        with pytest.raises(WorkloadError, match=r"w.jsonl:2: not valid JSON") as e:
            load_workload(p)
        assert "\n" not in str(e.value)


def test_arrivals_and_sizes_no_clock_can_hold_are_one_line(tmp_path):
    """arrival_s 1e300 passed the check and failed the run after the model loaded (exit 4), as
    --rate 1e-300 did; --kv-bytes 1e999 was an OverflowError traceback and --wait-timeout
    1e308 a device process's: each is refused before anything runs."""
    import json

    from scheduler.config import ConfigError, EngineConfig, parse_size
    from scheduler.harness.workload import SyntheticSpec

    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"prompt": "x", "max_new_tokens": 1, "arrival_s": 1e300}) + "\n")
    with pytest.raises(WorkloadError, match="arrival_s' must be between 0 and"):
        load_workload(p)
    with pytest.raises(WorkloadError, match="--rate 1e-300"):
        SyntheticSpec(8, rate=1e-300).check()
    with pytest.raises(ConfigError, match="cannot read size"):
        parse_size("1e999")
    for kw in ({"kv_bytes": parse_size("1e30")}, {"wait_timeout_s": 1e308}):
        with pytest.raises(ConfigError):
            EngineConfig(**kw).validate()


def test_a_line_without_an_id_takes_a_default_no_other_line_has(tmp_path):
    """Line 1 named "req-1"; line 2, unnamed, defaulted to req-1 too and was refused as a
    duplicate on a line that names no id. It takes another default; two lines that name one
    id are still refused."""
    import json

    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"id": "req-1", "prompt": "a", "max_new_tokens": 1}) + "\n"
                 + json.dumps({"prompt": "b", "max_new_tokens": 1}) + "\n")
    assert [it.request_id for it in load_workload(p)] == ["req-1", "req-1-2"]
    p.write_text(json.dumps({"id": "x", "prompt": "a", "max_new_tokens": 1}) + "\n"
                 + json.dumps({"id": "x", "prompt": "b", "max_new_tokens": 1}) + "\n")
    with pytest.raises(WorkloadError, match="duplicate request id 'x'"):
        load_workload(p)
