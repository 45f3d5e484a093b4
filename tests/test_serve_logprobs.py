"""`mstrace serve`'s logprobs and echo through the official openai client and raw HTTP, against
transformers' log_softmax of the same tokens on the same folder (the tiny preset)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.serve_proc import Served, sse_events

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
TOL = 1e-4


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scheduler.model.presets import resolve_model

    path = str(resolve_model("tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_no_new_tokens_scores_the_prompt_as_transformers_does(client, hf) -> None:
    prompt = "def parse_args(argv):\n    return argv"
    ids = hf[1](prompt)["input_ids"]  # BOS included, as the server encodes a completions prompt
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    ch = out.choices[0]
    assert ch.text == prompt and out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = ch.logprobs
    assert lp.tokens == [hf[1].decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = ref_logprobs(hf, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) < TOL
        top = ref[p - 1].topk(3)
        want = {hf[1].decode([int(i)]): float(v) for i, v in zip(top.indices, top.values, strict=True)}
        got = lp.top_logprobs[p]
        assert all(abs(got[t] - v) < TOL for t, v in want.items()), (got, want)
        assert len(got) <= 4  # the token's own entry and the 3 most likely
    # offsets into the choice's text: BOS (special, not in the text) takes no room
    assert lp.tokens[0] == "<s>" and lp.text_offset[:2] == [0, 0]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[1:i]) for i in range(len(ids))]
    assert all(ch.text[o:].startswith(t) for o, t in zip(lp.text_offset[1:], lp.tokens[1:], strict=True))


def test_lm_eval_shape_batch_of_token_ids_echo_one_token(server: Served, hf) -> None:
    """lm-evaluation-harness's local-completions loglikelihood request, as it sends it."""
    batch = [[1, 40, 41, 42, 43], [1, 50, 51, 52]]
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": batch, "max_tokens": 1, "echo": True,
                                                   "logprobs": 1, "temperature": 0, "seed": 1234})
    assert status == 200, body
    for ch, ids in zip(body["choices"], batch, strict=True):
        lps = ch["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None
        ref = ref_logprobs(hf, ids)
        for p in range(1, len(ids)):
            assert abs(lps[p] - float(ref[p - 1, ids[p]])) < TOL
        greedy = int(ref[-1].argmax())
        assert abs(lps[-1] - float(ref[-1, greedy])) < TOL  # the one generated token, greedy
        assert ch["text"].startswith(hf[1].decode(ids, skip_special_tokens=True))


def test_completion_logprobs_streamed_equal_whole_and_match_transformers(client, hf) -> None:
    kw = dict(model="tiny", prompt="import os\n", max_tokens=8, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and len(tokens) == 8
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert offsets == whole.logprobs.text_offset
    ids = hf[1]("import os\n")["input_ids"]
    seq = ids[:]
    ref_rows = []
    for lp, top in zip(whole.logprobs.token_logprobs, whole.logprobs.top_logprobs, strict=True):
        ref = ref_logprobs(hf, seq)[-1]
        tok = int(ref.argmax())  # greedy
        ref_rows.append((lp, float(ref[tok])))
        assert len(top) <= 3
        seq.append(tok)
    assert all(abs(a - b) < TOL for a, b in ref_rows), ref_rows


def test_chat_logprobs_and_top_logprobs_streamed_and_not(client) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6  # greedy: the token is the most likely
    streamed = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    items = [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in items] == [c.token for c in content]
    none = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2).choices[0]
    assert none.logprobs is None


def test_echo_without_logprobs_and_streamed_echo(server: Served) -> None:
    body = {"model": "tiny", "prompt": "x = 1", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = server.post("/v1/completions", body)[1]["choices"][0]
    echoed = server.post("/v1/completions", {**body, "echo": True})[1]["choices"][0]
    assert echoed["text"] == "x = 1" + plain["text"] and echoed["logprobs"] is None
    c = server.conn()
    c.request("POST", "/v1/completions", json.dumps({**body, "echo": True, "stream": True, "logprobs": 0}),
              {"Content-Type": "application/json"})
    events = [e for e in sse_events(c.getresponse()) if isinstance(e, dict)]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == echoed["text"]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) > 1  # the prompt's, then the token's


def test_bad_logprobs_fields_are_400_naming_them(server: Served) -> None:
    base = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for extra, param in (({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                         ({"max_tokens": 0}, "max_tokens")):
        status, body = server.post("/v1/completions", {**base, **extra})
        assert status == 400 and body["error"]["param"] == param, body
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, body = server.post("/v1/chat/completions", {**chat, "top_logprobs": 2})
    assert status == 400 and body["error"]["param"] == "top_logprobs", body
    status, body = server.post("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "top_logprobs", body

