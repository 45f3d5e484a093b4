"""bench-serve's SSE parser (viewer/bench_serve/sse.py) against WHATWG HTML's event-stream rules,
whatever the line ends and wherever the bytes are cut."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from viewer.bench_serve.sse import Event, SSEParser


def parse(*pieces: bytes) -> list[Event]:
    p = SSEParser()
    out = [e for piece in pieces for e in p.feed(piece)]
    return out + p.close()


def test_crlf_lines_and_data_without_a_space() -> None:
    assert parse(b'data:{"a":1}\r\n\r\ndata: [DONE]\r\n\r\n') == [Event('{"a":1}'), Event("[DONE]")]


def test_one_leading_space_is_dropped_and_only_one() -> None:
    assert parse(b"data:  two\n\ndata:none\n\ndata\n\n") == [Event(" two"), Event("none"), Event("")]


def test_multi_line_data_is_joined_with_lf() -> None:
    assert parse(b'data: {"a":\r\ndata: 1}\r\n\r\n') == [Event('{"a":\n1}')]


def test_comments_are_ignored_and_an_event_of_only_comments_dispatches_nothing() -> None:
    assert parse(b": ping\r\n\r\n:\r\ndata: x\r\n: inside\r\n\r\n") == [Event("x")]


def test_cr_alone_ends_a_line() -> None:
    assert parse(b"data: a\rdata: b\r\rdata: c\r\r") == [Event("a\nb"), Event("c")]


def test_a_cr_ending_one_piece_and_an_lf_starting_the_next_are_one_line_end() -> None:
    # were they two, the LF would be a blank line and dispatch "a" alone
    assert parse(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == [Event("a\nb")]


def test_an_event_is_out_as_soon_as_its_blank_line_is_in() -> None:
    p = SSEParser()
    assert p.feed(b"data: x\r\n") == []
    assert p.feed(b"\r") == [Event("x")]  # not held back waiting to see whether an LF follows


def test_event_and_id_fields() -> None:
    out = parse(b"event: error\nid: 7\ndata: boom\n\ndata: next\n\nid\ndata: reset\n\nid: a\0b\ndata: kept\n\n")
    assert out == [Event("boom", "error", "7"), Event("next", "message", "7"), Event("reset", "message", ""),
                   Event("kept", "message", "")]


def test_unknown_fields_and_retry_are_ignored() -> None:
    assert parse(b"retry: 10\nfoo: bar\ndata: x\n\n") == [Event("x")]


def test_a_leading_bom_is_dropped_even_split() -> None:
    assert parse(b"\xef", b"\xbb\xbfdata: x\n\n") == [Event("x")]
    assert parse(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n") == []  # only one: the second starts the field name


def test_an_event_cut_by_the_end_of_the_stream_is_dropped() -> None:
    assert parse(b"data: whole\n\ndata: half\n") == [Event("whole")]


def test_a_character_split_between_pieces_decodes_whole() -> None:
    raw = "data: é€😀\n\n".encode()
    assert parse(*(raw[i:i + 1] for i in range(len(raw)))) == [Event("é€😀")]


# A generated stream: events of fields and comments, every line with its own ending.
_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n\0"), max_size=12)
_line = st.one_of(
    st.tuples(st.just("data"), _text),
    st.tuples(st.just("event"), _text),
    st.tuples(st.just("id"), _text),
    st.tuples(st.just(":"), _text),
)
_events = st.lists(st.lists(_line, max_size=5), max_size=6)


def _expected(events: list[list[tuple[str, str]]]) -> list[Event]:
    out, last_id = [], ""
    for fields in events:
        data = [v for k, v in fields if k == "data"]
        kind = next((v for k, v in reversed(fields) if k == "event"), "")
        last_id = next((v for k, v in reversed(fields) if k == "id"), last_id)
        if data:
            out.append(Event("\n".join(data), kind or "message", last_id))
    return out


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[Event]]:
    events = draw(_events)
    lines: list[str] = []
    for fields in events:
        for k, v in fields:
            sep = draw(st.sampled_from([":", ": "])) if k != ":" else ""
            # a value that starts with a space needs the space after the colon, or loses it
            lines.append(f"{k}{': ' if v.startswith(' ') and k != ':' else sep}{v}")
        lines.append("")
    body, prev = "", ""
    for line in lines:
        ends = ["\r\n", "\n", "\r"]
        if prev == "\r" and line == "":
            ends.remove("\n")  # "\r" then "\n" would read as one CRLF, not as an end and a blank line
        prev = draw(st.sampled_from(ends))
        body += line + prev
    return body.encode(), _expected(events)


@settings(max_examples=400, deadline=None)
@given(stream=_streams(), cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_split_of_any_stream_gives_the_spec_events(stream: tuple[bytes, list[Event]], cuts: list[int]) -> None:
    raw, want = stream
    at = sorted({c % (len(raw) + 1) for c in cuts})
    pieces = [raw[a:b] for a, b in zip([0, *at], [*at, len(raw)], strict=True)]
    assert parse(raw) == want
    assert parse(*pieces) == want


@settings(max_examples=100, deadline=None)
@given(stream=_streams())
def test_byte_by_byte_gives_the_spec_events(stream: tuple[bytes, list[Event]]) -> None:
    raw, want = stream
    assert parse(*(raw[i:i + 1] for i in range(len(raw)))) == want
