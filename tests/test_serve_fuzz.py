"""Generated requests against a live server: whatever arrives, no 5xx, an OpenAI error
object for every refusal, and no block left held once the server stops."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cli import mstrace
from tests.support.serve_proc import Served

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("MSTRACE_SERVE_FUZZ_EXAMPLES", "500"))
STATUSES: dict[int, int] = {}

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                     | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_prompt = st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 70000), max_size=20), _json)
_maybe = st.one_of(st.just(None), st.just(...))  # ... = leave the field out
_sampling = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "tiny", "tiny", "other", ""]) | _json,
    "max_tokens": st.integers(-3, 12) | st.sampled_from([10**6, 2**63]) | _json,
    "temperature": st.floats(-1, 3, allow_nan=False) | _json,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | _json,
    "seed": st.integers(-2**63, 2**63) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
    "ignore_eos": st.booleans(),
    "n": st.integers(0, 3),
})
_completion = st.tuples(st.just("/v1/completions"), _sampling.flatmap(
    lambda d: st.fixed_dictionaries({"prompt": _prompt}).map(lambda p: {**d, **p})))
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]) | _json,
                                  "content": st.text(max_size=40) | _json})
_chat = st.tuples(st.just("/v1/chat/completions"), _sampling.flatmap(
    lambda d: st.fixed_dictionaries({"messages": st.lists(_message, max_size=3) | _json}).map(lambda m: {**d, **m})))
# well-formed ones too, so the fuzz also streams, stops, seeds and finishes real requests
_served = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 8)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "seed": st.integers(0, 2**31),
              "stop": st.text("ab ", max_size=2), "stream": st.booleans(), "ignore_eos": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})})
_good = st.one_of(
    st.tuples(st.just("/v1/completions"), _served.flatmap(
        lambda d: st.text(min_size=1, max_size=40).map(lambda t: {**d, "prompt": t}))),
    st.tuples(st.just("/v1/chat/completions"), _served.flatmap(
        lambda d: st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                  "content": st.text(max_size=30)}), min_size=1, max_size=3)
        .map(lambda m: {**d, "messages": m}))))
_raw = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=200))


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory):
    """Not the session's server (tests/conftest.py): the last test stops this one."""
    s = Served(tmp_path_factory.mktemp("fuzz") / "trace")
    yield s
    if s.proc.poll() is None:
        s.stop()


def _send(server: Served, path: str, body: bytes) -> tuple[int, bytes]:
    c = server.conn()
    c.request("POST", path, body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


# derandomized: the same requests every run, so the count of served ones below is fixed
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.one_of(_good, _good, _completion, _chat, _raw))
def test_generated_requests_never_get_a_5xx(own_server: Served, case) -> None:
    path, body = case
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply = _send(own_server, path, data)
    STATUSES[status] = STATUSES.get(status, 0) + 1
    assert status < 500, reply[:300]
    if status >= 400:
        err = json.loads(reply)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif b"data: " in reply[:6]:
        assert reply.rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(reply)["choices"]


def test_after_the_fuzz_nothing_is_held(own_server: Served, tmp_path: Path) -> None:
    print("statuses:", dict(sorted(STATUSES.items())))
    assert sum(STATUSES.values()) >= EXAMPLES and STATUSES.get(200, 0) >= EXAMPLES // 20  # some were served
    rc, _, err = own_server.stop()
    assert rc == 0, err
    leaks = mstrace("leaks", str(own_server.out))
    assert leaks.returncode == 0 and "no leaks" in leaks.stdout, leaks.stdout + leaks.stderr
