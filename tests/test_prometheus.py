"""docs/grafana/mstrace.json against a real Prometheus: Debian's `prometheus` (installed by
`bash setup.sh --test`) scrapes `mstrace serve` every second while it serves requests, and
every query of the dashboard, and the PromQL docs/serve.md gives, returns finite data."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import REPO
from tests.support.serve_proc import Served, sse_events

DASHBOARD = REPO / "docs" / "grafana" / "mstrace.json"
DS_UID = "${DS_PROMETHEUS}"
DEADLINE_S = 180  # generous: every wait below polls for a condition, this only bounds it
# vLLM's own dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries
# names vLLM has since renamed; ours uses the new names, so the old ones are checked here.
VLLM_OLD_NAMES = [
    'histogram_quantile(0.99, sum by(le) (rate(mstrace:time_per_output_token_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(mstrace:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(mstrace:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'mstrace:gpu_cache_usage_perc{model_name="$model_name"}',
    'rate(mstrace:gpu_prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(mstrace:gpu_prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval])',
]


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    assert found, ("no prometheus binary: `bash setup.sh --test` installs Debian's package "
                   "(apt-get install prometheus)")
    return found


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row keeps its panels inside


def targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query."""
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


def test_the_dashboard_is_a_grafana_model_with_a_datasource_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["schemaVersion"], int) and dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == DS_UID and p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == DS_UID and t["expr"] for t in p["targets"]), p["title"]
    exprs = " ".join(e for _, e in targets(dash))
    for name in ("boundary_seconds_total", "cost_cycle_seconds_total", "cycle_seconds_bucket", "stalls_total"):
        assert f"mstrace:{name}" in exprs  # the sync-cost panels no other engine has


class Prometheus:
    """The binary itself on a loopback port of its own choosing, with a throwaway config and
    database: not the Debian service."""

    def __init__(self, tmp: Path, target_port: int) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = tmp / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                       "scrape_configs:\n  - job_name: mstrace\n    static_configs:\n"
                       f"      - targets: ['127.0.0.1:{target_port}']\n")
        self.log = tmp / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 "--web.listen-address=127.0.0.1:0"], stdout=log, stderr=subprocess.STDOUT)
        # port 0: the kernel picks a free one, which its log then names (no port race)
        self.port = 0
        deadline = time.monotonic() + DEADLINE_S
        while not self.port:
            if m := re.search(r'msg="Listening on" address=127\.0\.0\.1:(\d+)', self.log.read_text()):
                self.port = int(m.group(1))
            else:
                assert self.proc.poll() is None and time.monotonic() < deadline, \
                    f"prometheus did not start: {self.log.read_text()[-3000:]}"
                time.sleep(0.2)
        self.wait_for(self._ready, "prometheus ready")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=10) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        args = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(args)
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/label/{label}/values?"
               + urllib.parse.urlencode({"match[]": match}))
        with urllib.request.urlopen(url, timeout=30) as r:
            values: list[str] = json.load(r)["data"]
        return values

    def scalar(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def wait_for(self, ok: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not ok():
            assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def load(s: Served, workers: int = 4, each: int = 6) -> int:
    """Completions and chats, streamed and not, from a few clients at once; how many finished."""
    errors: list[str] = []

    def one(k: int, i: int) -> bool:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 8 + (i % 3) * 4, "temperature": 0, "ignore_eos": True}
        if (k + i) % 3 == 2:
            st, out = s.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"hi {k}"}]})
            return st == 200 and out["usage"]["completion_tokens"] == body["max_tokens"]
        if (k + i) % 2:
            # tokens counted by the usage chunk: a chunk holds back a token that ends inside a
            # UTF-8 character (bfloat16's tokens follow the batches' shapes, which timing sets)
            c, resp = s.stream({**body, "prompt": f"def f{k}_{i}(x):", "stream_options": {"include_usage": True}})
            ev = sse_events(resp)
            c.close()
            return (resp.status == 200 and ev[-1] == "[DONE]"
                    and ev[-2]["usage"]["completion_tokens"] == body["max_tokens"])
        st, out = s.post("/v1/completions", {**body, "prompt": f"print({k}, {i})"})
        return st == 200 and out["usage"]["completion_tokens"] == body["max_tokens"]

    def client(k: int) -> None:
        for i in range(each):
            try:
                if not one(k, i):
                    errors.append(f"client {k} request {i}: a wrong reply")
            except Exception as e:  # noqa: BLE001 - reported by the test's thread, not lost in this one
                errors.append(f"client {k} request {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return workers * each


def doc_promql() -> list[str]:
    """The PromQL docs/serve.md gives (inline code that divides rates)."""
    text = (REPO / "docs" / "serve.md").read_text()
    found = re.findall(r"`([^`]*rate\([^`]*)`", text)
    assert found, "docs/serve.md gives no PromQL"
    return found


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    queries = [*targets(dash), *(("vLLM's dashboard, old name", e) for e in VLLM_OLD_NAMES),
               *(("docs/serve.md", e) for e in doc_promql())]
    s = Served(tmp_path / "trace")
    prom: Prometheus | None = None
    try:
        prom = Prometheus(tmp_path / "prom", s.port)
        sel = '{model_name="tiny"}'
        # a sample from before the load, so every rate() over the window has its left end
        prom.wait_for(lambda: prom.query(f"mstrace:num_requests_running{sel}"), "a scrape of the server")
        first_ts = prom.scalar(f"timestamp(mstrace:num_requests_running{sel})")
        cycles_before = prom.scalar(f"mstrace:cost_cycle_seconds_total{sel}")
        assert first_ts is not None and cycles_before is not None
        finished = load(s)
        # Prometheus has the load when it has every finished request and the live cost table
        # has grown (it trails the run by a few rounds and a commit)...
        prom.wait_for(lambda: prom.scalar(f"sum(mstrace:request_success_total{sel})") == finished,
                      f"{finished} finished requests in prometheus")
        prom.wait_for(lambda: (prom.scalar(f"mstrace:cost_cycle_seconds_total{sel}") or 0) > cycles_before,
                      "the live cost counters")
        # ...and two scrapes more, so even a series that first appeared in the last one has
        # the two samples rate() needs
        seen = prom.scalar(f"timestamp(mstrace:cost_cycle_seconds_total{sel})")
        assert seen is not None
        prom.wait_for(lambda: (prom.scalar(f"timestamp(mstrace:num_requests_running{sel})") or 0) >= seen + 1.5,
                      "two more scrapes")
        assert prom.label_values("model_name", "mstrace:num_requests_running") == ["tiny"]  # $model_name's query

        at = time.time()
        window = f"{math.ceil(at - first_ts) + 2}s"  # Grafana's $__rate_interval, here: the whole run
        empty, not_finite = [], []
        for title, expr in queries:
            q = expr.replace("$__rate_interval", window).replace("$model_name", "tiny").replace("[1m]", f"[{window}]")
            res = prom.query(q, at)
            if not res:
                empty.append((title, q))
            elif not all(math.isfinite(float(r["value"][1])) for r in res):
                not_finite.append((title, q, [r["value"][1] for r in res]))
        assert not empty, f"{len(empty)} of {len(queries)} queries returned nothing: {empty}"
        assert not not_finite, f"{len(not_finite)} of {len(queries)} queries are not finite: {not_finite}"
    finally:
        if prom is not None:
            prom.stop()
        rc, _, err = s.stop()
    assert rc == 0, err
