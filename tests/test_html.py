"""`report --html` and `diff --html`: the page is drawn by a headless Chromium with the
network shut off, and every chart draws, with no script error."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import mstrace
from tests.support.tiny_runs import TinyRuns

CHROMIUM = shutil.which("chromium-headless-shell") or shutil.which("chromium")
# no network at view time: every host resolves to nothing, and no proxy is tried
NO_NET = ["--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND", "--no-proxy-server",
          "--virtual-time-budget=15000"]


@pytest.fixture(scope="module")
def traces(tiny_runs: TinyRuns, overlap_trace: Path) -> tuple[Path, Path]:
    return tiny_runs("--requests", "24", "--mode", "serial", "-q").out, overlap_trace


def _open(page: Path, png: Path) -> str:
    assert CHROMIUM, "no chromium-headless-shell: `bash setup.sh --test` installs it (Debian's package)"
    dom = subprocess.run([CHROMIUM, *NO_NET, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    subprocess.run([CHROMIUM, *NO_NET, "--hide-scrollbars", "--window-size=1280,2300", f"--screenshot={png}",
                    page.as_uri()], capture_output=True, timeout=120, cwd=png.parent)
    return dom


def _check(page: Path, tmp_path: Path, charts: int) -> None:
    text = page.read_text()
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", text)  # nothing to fetch: all inline
    dom = _open(page, tmp_path / "shot.png")
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', body.group(0)))
    assert attrs["errors"] == "", attrs["errors"]
    assert attrs["charts"] == attrs["drawn"] == str(charts)
    for i in range(charts):  # each chart's element holds a drawn plot with marks in it
        div = dom.split(f'id="chart{i}"', 1)[1].split('class="chart"', 1)[0]
        assert "main-svg" in div and re.search(r'class="(point|trace|bars|scatterlayer|barlayer)', div)
    assert (tmp_path / "shot.png").stat().st_size > 20_000


def test_a_report_page_draws_offline(traces: tuple[Path, Path], tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    p = mstrace("report", str(traces[1]), "--html", str(page))
    assert p.returncode == 0, p.stderr
    assert "device_compute" in page.read_text() and "sync-cost table" in p.stdout
    assert p.stderr.strip() == f"HTML written to {page.resolve()}", p.stderr  # where it went (issue 25, 8)
    assert "critical path of the overlap run" in page.read_text()  # the round model's picture (docs/whatif.md)
    # what the CPU emulation adds to which row, as the text report says it
    assert "cpu-process (emulated): device_compute includes building the forward batch" in page.read_text()
    _check(page, tmp_path, 5)


def test_a_diff_page_draws_offline(traces: tuple[Path, Path], tmp_path: Path) -> None:
    page = tmp_path / "diff.html"
    p = mstrace("diff", str(traces[0]), str(traces[1]), "--html", str(page))
    assert p.returncode == 0, p.stderr
    assert f"HTML written to {page.resolve()}" in p.stderr, p.stderr
    text = page.read_text()
    # significant deltas first (whether any is significant depends on how quiet the machine was)
    rows = re.findall(r"<tr class=(\w+)", text)
    assert rows and rows == sorted(rows, key=lambda c: c != "sig")
    # the text diff's labels and units, not the JSON's keys and raw fractions
    table = text[text.index("<h2>B - A"):]
    assert "boundaries " not in table and "host_share" not in table and " pp" in table and "e-0" not in table
    _check(page, tmp_path, 3)


def test_an_unwritable_page_is_one_line(traces: tuple[Path, Path], tmp_path: Path) -> None:
    p = mstrace("report", str(traces[0]), "--html", str(tmp_path / "no" / "such" / "dir.html"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    # a folder, or a path with no name (`.`), for the page: said before any work, nothing left behind
    for out in (str(tmp_path), "."):
        for cmd in (["report", str(traces[0])], ["diff", str(traces[0]), str(traces[1])]):
            p = mstrace(*cmd, "--html", out)
            assert p.returncode == 2 and "give a file to write" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.tmp"))


def test_a_page_says_no_data_and_names_what_it_shows() -> None:
    """A stalled run may have no finished request: its CDFs say "no data" rather than draw
    empty axes; one trace's CDFs have no legend (its one entry was blank); "worth attacking"
    shows its code spans as code, not backticks (issue 25, point 8)."""
    from tracing.schema import TABLES
    from viewer.export import html_charts as charts
    from viewer.export.html import _worth

    empty = charts.ChartInputs(TABLES["probes"].empty_table(), TABLES["steps"].empty_table(),
                               TABLES["requests"].empty_table())
    fig = charts.latency_cdfs([("", empty)])
    assert [a.text for a in fig.layout.annotations].count("no data") == 3
    assert not any(t.showlegend for t in fig.data) and all(t.name for t in fig.data)
    two = charts.latency_cdfs([("A", empty), ("B", empty)])
    assert {t.name for t in two.data if t.showlegend} == {"A", "B"}
    assert _worth({"worth_attacking": ["bookkeeping: try `--gc-after-s 5` <now>"]}) == [
        "<p class=note>worth attacking: bookkeeping: try <code>--gc-after-s 5</code> &lt;now&gt;</p>"]


def test_a_stalled_trace_page_says_so_first() -> None:
    from viewer.export.html import _status

    rep = {"trace": "t", "status": {"state": "stalled", "detail": "scheduler waited 2.0 s for event main#7"}}
    line = _status(rep)
    assert len(line) == 1 and "STALLED" in line[0] and "mstrace stalls t" in line[0] and "main#7" in line[0]
    assert _status({"trace": "t", "status": {"state": "complete", "detail": ""}}) == []


# Injected into a copy of a page: once its charts drew, what a reader at this window width
# would find cut off, as <body data-cut="...">: the page wider than the window, a table past
# the window's edge outside a box that scrolls it, a value broken over lines ("+23.3" over
# "pp"), a CI broken inside one of its ends, the timeline's axis stretched far left of 0.
LAYOUT = """<script>(function(){function look(){var b=document.body;
if(b.dataset.drawn!==b.dataset.charts&&!b.dataset.errors){return setTimeout(look,50);}
var w=document.documentElement.clientWidth,cut=[],d=document.documentElement;
if(d.scrollWidth>w){cut.push('page '+d.scrollWidth+' px wide');}
document.querySelectorAll('table').forEach(function(t){var e=t.parentElement;
 while(e&&e!==b&&['auto','scroll'].indexOf(getComputedStyle(e).overflowX)<0){e=e.parentElement;}
 if((!e||e===b)&&t.getBoundingClientRect().right>w){cut.push('table past the edge: '+t.rows[0].textContent);}});
document.querySelectorAll('td:not(:first-child)').forEach(function(td){var r=document.createRange();
 r.selectNodeContents(td);var lines=new Set(Array.from(r.getClientRects()).map(function(x){return Math.round(x.top);})).size;
 if(lines>(td.classList.contains('ci')?2:1)){cut.push(lines+' lines: '+td.textContent);}});
document.querySelectorAll('.chart').forEach(function(c){var l=c._fullLayout;
 if(l&&/^timeline/.test(l.title.text)){var x=l.xaxis.range;
  if(x[0]<-0.05*(x[1]-x[0])){cut.push('timeline from '+x[0].toFixed(1)+' ms');}}});
b.dataset.cut=cut.join(' | ');}setTimeout(look,0);})();</script>"""


def _cut_at(page: Path, width: int) -> str:
    assert CHROMIUM, "no chromium-headless-shell: `bash setup.sh --test` installs it (Debian's package)"
    probe = page.with_name(f"{page.stem}-{width}.html")
    probe.write_text(page.read_text().replace("</body>", LAYOUT + "</body>"))
    # as tall as the other tests' window: the page grows past it only as the charts draw
    dom = subprocess.run([CHROMIUM, *NO_NET, f"--window-size={width},2300", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', body.group(0)))
    assert attrs["errors"] == "" and attrs["drawn"] == attrs["charts"], attrs
    return attrs["cut"]


@pytest.mark.slow
def test_pages_cut_nothing_off_narrow_or_wide(traces: tuple[Path, Path], tmp_path: Path) -> None:
    """At a 640 px and a 1600 px window, a report page and a diff page fit: the long trace
    path in the heading wraps, the tables fit or scroll on their own, each value stays on
    one line, the charts stay inside the window and the timeline's axis at its bars."""
    where = tmp_path / "ci_runner_workspace_checkout_of_the_branch_under_test"  # no place to break a line
    where.mkdir()
    for t in traces:
        (where / t.name).symlink_to(t)
    a, b = where / traces[0].name, where / traces[1].name
    report, diff = tmp_path / "report.html", tmp_path / "diff.html"
    assert mstrace("report", str(b), "--html", str(report)).returncode == 0
    assert mstrace("diff", str(a), str(b), "--html", str(diff)).returncode == 0
    cut = {(page.name, width): _cut_at(page, width) for page in (report, diff) for width in (640, 1600)}
    assert not any(cut.values()), cut


def test_the_timeline_clips_rows_to_its_window() -> None:
    """A wait that began long before the window's first round is drawn from the window's
    start (its hover keeps its own start): the axis never stretches left of 0 for it
    (a loaded machine made such rows, and the page's axis ran from -4.3 ms)."""
    import pyarrow as pa

    from tracing.schema import TABLES
    from viewer.export import html_charts as charts

    ms = 1_000_000
    steps = TABLES["steps"].empty_table().to_pylist()
    for i in range(3):
        steps.append({c: 0 for c in TABLES["steps"].names} | {"step": i, "mode": "serial", "ts_ns": 100 * ms + 10 * ms * i,
                                                               "dur_ns": 10 * ms})
    probes = [{"ts_ns": 50 * ms, "dur_ns": 60 * ms, "boundary": "idle", "stream": "host", "rank": 0, "step": -1},
              {"ts_ns": 125 * ms, "dur_ns": 40 * ms, "boundary": "device_compute", "stream": "main", "rank": 0,
               "step": 2}]
    inp = charts.ChartInputs(pa.Table.from_pylist(probes, TABLES["probes"]),
                             pa.Table.from_pylist(steps, TABLES["steps"]), TABLES["requests"].empty_table())
    fig = charts.timeline(inp)
    x0, x1 = fig.layout.xaxis.range
    assert -0.5 < x0 <= 0 and 30 <= x1 < 30.5
    bars = {t.name: t for t in fig.data}
    assert list(bars["idle"].base) == [0.0] and list(bars["idle"].x) == [10.0]
    assert list(bars["idle"].customdata[0]) == [-50.0, 60.0]
    assert list(bars["device_compute"].base) == [25.0] and list(bars["device_compute"].x) == [5.0]


def test_a_windowed_report_draws_its_rounds_and_says_what_it_left_out(traces: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    page = tmp_path / "window.html"
    p = mstrace("report", str(traces[0]), "--html", str(page), "--rounds", "3-6")
    assert p.returncode == 0, p.stderr
    text = page.read_text()
    assert "Timeline window: rounds 3-6: rounds 3-6 drawn (4 rounds" in text
    assert "timeline: rounds 3-6" in text  # the chart's own title
    _check(page, tmp_path, 5)
    p = mstrace("report", str(traces[0]), "--html", str(page), "--worst", "2")
    assert p.returncode == 0 and "the 2 slowest rounds" in page.read_text(), p.stderr
    for args, says in ((["--rounds", "3-6"], "add --html"),
                       (["--html", str(tmp_path / "x.html"), "--rounds", "90000-90001"], "the trace has rounds"),
                       (["--html", str(tmp_path / "x.html"), "--rounds", "1-2", "--worst", "1"], "give one window")):
        p = mstrace("report", str(traces[0]), *args)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x.html").exists()


def test_a_long_window_draws_at_most_its_share_around_its_longest_round() -> None:
    import numpy as np
    import pyarrow as pa

    from viewer.export import html_charts as charts
    from viewer.export.html import timeline_note
    from viewer.export.window import Window

    n, ms = 1000, 1_000_000
    dur = np.full(n, 10 * ms)
    dur[700] = 50 * ms  # the longest round of the trace, outside the window below
    dur[400] = 30 * ms  # the window's longest
    ts = np.concatenate([[0], np.cumsum(dur)[:-1]])
    steps = pa.table({"step": np.arange(n), "ts_ns": ts, "dur_ns": dur})
    w = Window(((int(ts[100]), int(ts[599] + dur[599])),), "t")
    span = charts.timeline_span(steps, w)
    assert span is not None and span.in_window == 500
    assert span.hi - span.lo + 1 == charts.TIMELINE_ROUNDS and span.lo <= 400 <= span.hi
    assert span.worst == 400 and 100 <= span.lo and span.hi <= 599
    near_end = Window(((int(ts[590]), int(ts[599] + dur[599])),), "t")
    s2 = charts.timeline_span(steps, near_end)
    assert s2 is not None and (s2.lo, s2.hi, s2.in_window) == (590, 599, 10)
    assert charts.timeline_span(steps, Window(((int(ts[-1]) + 10**12, int(ts[-1]) + 2 * 10**12),), "t")) is None
    # two rounds far apart (as --worst picks them): the stretch drawn around the longer one
    # holds one of the window's two rounds, and the page's note says the other is left out
    apart = Window(((int(ts[10]), int(ts[10] + dur[10])), (int(ts[700]), int(ts[700] + dur[700]))), "the 2 slowest")
    s3 = charts.timeline_span(steps, apart)
    assert s3 is not None and s3.in_window == 2 and s3.drawn_in_window == 1 and s3.lo <= 700 <= s3.hi
    empty = pa.table({"ts_ns": pa.array([], pa.int64())})
    assert "1 of the window's rounds left out" in timeline_note(apart, charts.ChartInputs(empty, steps, empty, s3))


def test_the_timeline_reads_its_last_rounds_cycle(traces: tuple[Path, Path]) -> None:
    """The probe rows a windowed timeline reads run to its last round's cycle end: that
    round's response_send, which comes after the round's own end, is drawn with it."""
    from tracing.reader import Trace, read_table
    from viewer.export.html import chart_inputs
    from viewer.export.window import parse_window

    root = traces[0]
    steps = read_table(root, "steps").sort_by("ts_ns").to_pydict()
    i = len(steps["step"]) // 2
    last = steps["step"][i]
    end = steps["ts_ns"][i] + steps["dur_ns"][i]
    probes = read_table(root, "probes").to_pydict()
    after = [t for t, b, s in zip(probes["ts_ns"], probes["boundary"], probes["step"], strict=True)
             if s == last and t >= end and b == "response_send"]
    assert after  # the round's response_send starts after its end
    inp = chart_inputs(root, parse_window(Trace.open(root), rounds=f"{steps['step'][i - 2]}-{last}"))
    assert set(after) <= set(inp.probes["ts_ns"].to_pylist())
