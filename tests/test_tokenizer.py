"""Tokens as the folder's own tokenizer gives them, and streamed text equal to the full
decode, for every tokenizer family a Llama-family folder can carry (tests/support/tokenizer_families.py)
and for the embedded presets' tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.hops.sender import FinishedRecord, Sender, StepOutput
from scheduler.hops.tokenizer import Tokenizer
from scheduler.model.presets import resolve_model
from scheduler.model.tokenizer_build import BOS_ID, EOS_ID
from scheduler.serving.chat import ChatTemplate
from scheduler.serving.protocol import ChatMessage
from scheduler.serving.stop import StopMatcher
from tests.support.tokenizer_families import FAMILIES, MULTIBYTE, build_family

# Texts drawn from what tokenizes interestingly: words and spaces (merges at the seam, a
# Metaspace decoder's leading space), newlines, multi-byte characters in the vocabulary,
# and ones that are not (byte-level BPE splits them across tokens).
ALPHABET = st.sampled_from(list("abcdefghij klmnop qrst  ,.\n\t") + list(MULTIBYTE) + ["🦀", "ꙮ", "\u0301"])
TEXT = st.text(ALPHABET, min_size=0, max_size=40)
EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=FAMILIES + ("tiny",))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "tiny":
        return resolve_model("tiny")
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def hf(folder: Path):  # noqa: ANN201 - transformers' tokenizer, the oracle
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@EXAMPLES
@given(text=TEXT)
def test_prompt_ids_equal_autotokenizer(tok: Tokenizer, hf, text: str) -> None:  # noqa: ANN001
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    ids = tok.encode(text + " </s>")
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_a_content_part_that_is_not_text_is_refused_alike_with_or_without_a_template(folder: Path) -> None:
    """An image part: the same 400 (`messages.content`, unsupported_parameter) whether the
    folder has a chat template or the plain one renders it, not the template's refusal."""
    from scheduler.serving.protocol import BadRequest

    msgs = [ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": "data:,"}}]})]
    with pytest.raises(BadRequest) as e:
        ChatTemplate(folder).render(msgs)
    assert (e.value.param, e.value.code) == ("messages.content", "unsupported_parameter"), e.value.message


def test_a_prompt_gets_the_bos_its_config_asks_for(folder: Path, tok: Tokenizer) -> None:
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True
    ids = tok.encode("the argument parser")
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert tok.encode("the argument parser", add_special_tokens=False) == ids[1:]
    assert tok.special_prefix() == "<s>"


def test_chat_prompt_ids_equal_the_template_tokenized_and_bos_is_not_doubled(folder: Path, tok: Tokenizer,
                                                                              hf) -> None:  # noqa: ANN001
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="héllo, wörld"),
            ChatMessage(role="assistant", content="hi"), ChatMessage(role="user", content="again 🎉")]
    chat = ChatTemplate(folder, tok.special_prefix())
    ids = tok.encode(chat.render(msgs), add_special_tokens=False)
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID
    if chat.kind == "the model's":
        want = hf.apply_chat_template([{"role": m.role, "content": m.text()} for m in msgs], tokenize=True,
                                      add_generation_prompt=True)["input_ids"]
        assert ids == want
    else:  # the plain template (the presets): its own documented text, with the BOS
        assert chat.render(msgs).startswith("<s>system: be brief\n")


def _output_ids(tok: Tokenizer, text: str, specials: list[int], raw: list[int]) -> list[int]:
    """A model's output: the tokens of a text, special tokens among them, and some ids a
    random-weight model might sample anywhere in the vocabulary."""
    ids = tok.encode(text, add_special_tokens=False)
    for i, s in enumerate(specials):
        ids.insert((i * 7919) % (len(ids) + 1), s)
    return ids + [r % tok.vocab_size() for r in raw]


def _stream(tok: Tokenizer, prompt: list[int], out: list[int]) -> list[str]:
    d = tok.detokenizer(prompt)
    chunks = [d.push([t]) for t in out]
    chunks[-1:] = [(chunks[-1] if chunks else "") + d.flush()]
    return chunks


SPECIALS = st.lists(st.sampled_from([BOS_ID, EOS_ID]), max_size=2)
RAW = st.lists(st.integers(0, 10_000), max_size=3)


@EXAMPLES
@given(prompt=TEXT, output=TEXT, specials=SPECIALS, raw=RAW, bos=st.booleans())
def test_streamed_text_equals_the_full_decode(tok: Tokenizer, prompt: str, output: str, specials: list[int],
                                              raw: list[int], bos: bool) -> None:
    p = tok.encode(prompt, add_special_tokens=bos)
    o = _output_ids(tok, output, specials, raw)
    want = tok.decode(p + o)[len(tok.decode(p)):]
    assert "".join(_stream(tok, p, o)) == want


@EXAMPLES
@given(text=st.text(ALPHABET, min_size=2, max_size=40), cut=st.integers(1, 200))
def test_a_prompt_that_ends_inside_a_character_gets_that_character_with_the_output(
        tok: Tokenizer, text: str, cut: int) -> None:
    """A continuation of an output cut inside a character (its ids sent back as the prompt):
    the output's text starts with the whole character its first tokens complete. The
    prompt's tokens of that character were counted as emitted: the character was lost, and
    every later chunk cut at the wrong place."""
    ids = tok.encode(text, add_special_tokens=False)
    p, o = ids[:cut % len(ids)], ids[cut % len(ids):]
    whole = len(p)
    while whole and tok.decode(p[:whole]).endswith("\ufffd"):
        whole -= 1  # the prompt's tokens up to its last whole character
    assert "".join(_stream(tok, p, o)) == tok.decode(ids)[len(tok.decode(p[:whole])):]


@EXAMPLES
@given(prompt=TEXT, output=st.text(ALPHABET, min_size=4, max_size=40), cut=st.tuples(st.integers(0, 39),
       st.integers(1, 4)), specials=SPECIALS)
def test_stop_strings_split_across_tokens_end_the_text_where_the_full_decode_has_them(
        tok: Tokenizer, prompt: str, output: str, cut: tuple[int, int], specials: list[int]) -> None:
    p = tok.encode(prompt)
    o = _output_ids(tok, output, specials, [])
    whole = tok.decode(p + o)[len(tok.decode(p)):]
    start = cut[0] % max(len(whole), 1)
    stop = whole[start:start + cut[1]]
    if not stop:
        return
    m = StopMatcher([stop])
    sent = "".join(m.push(c) for c in _stream(tok, p, o)) + m.flush()
    assert sent == whole[:whole.find(stop)]


class _Sink:
    def __init__(self) -> None:
        self.text: dict[str, list[str]] = {}
        self.final: dict[str, str] = {}

    def on_text(self, request_id: str, text: str) -> None:
        self.text.setdefault(request_id, []).append(text)

    def on_finish(self, record: FinishedRecord, text: str) -> None:
        self.final[record.request_id] = text


def _record(rid: str, prompt: list[int], out: list[int]) -> FinishedRecord:
    return FinishedRecord(rid, prompt, out, 0, "length", "", 0, 0, 0, 0, 0, 0, 0, 0, 0, [])


def test_the_sender_decodes_each_request_after_its_own_prompt(tok: Tokenizer) -> None:
    """Through the sender: the prompt rides with a request's first token (collect's
    `out_prompts`), and each request's text is the full decode's tail."""
    sink = _Sink()
    s = Sender(tok, [sink])
    prompts = {"a": tok.encode("Create"), "b": tok.encode("a naïve")}
    outs = {"a": tok.encode(" the argument parser", add_special_tokens=False),
            "b": tok.encode(" café 日本", add_special_tokens=False)}
    n = max(map(len, outs.values()))
    for i in range(n):
        step = StepOutput(i, [(r, o[i]) for r, o in outs.items() if i < len(o)],
                          {r: prompts[r] for r in outs} if i == 0 else {})
        step.finished = [_record(r, prompts[r], o) for r, o in outs.items() if i == len(o) - 1]
        s.queue.put(step)
    s.close()
    for r, o in outs.items():
        want = tok.decode(prompts[r] + o)[len(tok.decode(prompts[r])):]
        assert "".join(sink.text[r]) == want == sink.final[r]
        assert len(sink.text[r]) == len(o)  # one text per token


def test_a_sink_that_raises_costs_only_its_own_call(tok: Tokenizer) -> None:
    """A sink raising on one request's token or finish: the other sinks, and the round's other
    requests, still get theirs (a stream left without its end would hang), and close() raises
    the first error."""
    class Broken(_Sink):
        def on_text(self, request_id: str, text: str) -> None:
            if request_id == "a":
                raise KeyError(request_id)
            super().on_text(request_id, text)

        def on_finish(self, record: FinishedRecord, text: str) -> None:
            if record.request_id == "a":
                raise KeyError(record.request_id)
            super().on_finish(record, text)

    broken, sink = Broken(), _Sink()
    s = Sender(tok, [broken, sink])
    prompts = {r: tok.encode("hi") for r in "ab"}
    outs = {r: tok.encode(" there", add_special_tokens=False) for r in "ab"}
    for i in range(len(outs["a"])):
        step = StepOutput(i, [(r, o[i]) for r, o in outs.items()], prompts if i == 0 else {})
        step.finished = [_record(r, prompts[r], o) for r, o in outs.items() if i == len(o) - 1]
        s.queue.put(step)
    with pytest.raises(RuntimeError, match="output sink failed"):
        s.close()
    assert sink.final == {"a": " there", "b": " there"} and "".join(sink.text["a"]) == " there"
    assert broken.final == {"b": " there"} and "a" not in broken.text


def test_a_preset_is_read_as_autotokenizer_builds_it_without_importing_transformers() -> None:
    """A preset's tokenizer.json is read directly (scheduler/hops/tokenizer.py): it must be
    exactly the Rust tokenizer AutoTokenizer builds from the folder, added tokens included."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    folder = resolve_model("tiny")
    ours = Tokenizer(folder)
    built = AutoTokenizer.from_pretrained(str(folder), local_files_only=True).backend_tokenizer
    assert ours._tok.to_str() == built.to_str()  # noqa: SLF001 - the object it encodes with
    code = (f"import sys; from scheduler.hops.tokenizer import Tokenizer; Tokenizer({str(folder)!r}); "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], timeout=120).returncode == 0


def test_a_prompt_ending_in_a_literal_replacement_character_is_not_taken_for_a_cut_one(tok: Tokenizer) -> None:
    """U+FFFD typed in the prompt is a whole character: the output does not repeat it (the
    walk back over a prompt cut inside a character took it for one and echoed it)."""
    p = tok.encode("price: 5\ufffd", add_special_tokens=False)
    o = tok.encode(" dollars", add_special_tokens=False)
    assert "".join(_stream(tok, p, o)) == tok.decode(p + o)[len(tok.decode(p)):]
