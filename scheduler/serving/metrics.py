"""GET /metrics: vLLM v1's metrics under the `mstrace:` prefix, plus what vLLM lacks.

Names, labels (model_name, engine) and histogram bucket edges follow vLLM v1, so a
vLLM Grafana dashboard works after replacing `vllm:` with `mstrace:` (the mapping
and where each value comes from: docs/serve.md, "Metrics"). vLLM's old names of
renamed metrics, some of which its published dashboard still queries, are exported
too, re-emitting the one metric under the old name: a figure is measured once.
Nothing here runs on the scheduling thread but `on_round`, a few integer adds and
one list append per round; request histograms are observed on the sender thread as
requests finish, and gauges are read from the engine when Prometheus scrapes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from scheduler.hops.sender import FinishedRecord
from scheduler.serving.protocol import FINISH_REASON, STOP_MATCHED

P = "mstrace:"
LABELS = ["model_name", "engine"]
# vLLM v1's bucket edges (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
# A scheduling round is milliseconds, not seconds: finer edges than vLLM's (it has no such metric).
CYCLE_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    m = 1
    while True:
        for k in (1, 2, 5):
            if k * m > limit:
                return out
            out.append(float(k * m))
        m *= 10


class ServerMetrics:
    def __init__(self, model: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine: Any = None  # set once it exists: the live gauges read it
        self._labels = (model, "0")
        # round lengths (ns) from the scheduling thread, folded into the histogram by the
        # sender thread or a scrape (deque: append and popleft are atomic)
        self._cycles: deque[int] = deque()
        self.prompt_tokens = 0  # prefill tokens computed (scheduling thread, per round)
        self.generation_tokens = 0
        r = self.registry
        fams: dict[str, Any] = {}  # name -> the labelled parent, which an alias re-emits

        def hist(name: str, doc: str, buckets: list[float]) -> Any:
            fams[name] = Histogram(P + name, doc, LABELS, registry=r, buckets=buckets)
            return fams[name].labels(*self._labels)

        def counter(name: str, doc: str) -> Any:
            fams[name] = Counter(P + name, doc, LABELS, registry=r)
            return fams[name].labels(*self._labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token collected).",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gaps between a request's tokens.", TOKEN_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "A request's decode time per output token.",
                         TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Queued to admitted (WAITING).", REQUEST_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First scheduled to finish (RUNNING).",
                              REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token (PREFILL).",
                            REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish (DECODE).", REQUEST_BUCKETS)
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.", buckets_1_2_5(max_model_len))
        self.gen_hist = hist("request_generation_tokens", "Generated tokens per request.",
                             buckets_1_2_5(max_model_len))
        self.cycle = hist("cycle_seconds", "Scheduling round length (mstrace; not in vLLM).", CYCLE_BUCKETS)
        success = Counter(P + "request_success", "Finished requests by reason.", [*LABELS, "finished_reason"],
                          registry=r)
        self.success = {v: success.labels(*self._labels, v) for v in dict.fromkeys(FINISH_REASON.values())}
        self.preemptions = counter("num_preemptions", "Preemptions (counted as their requests finish).")
        self.pc_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.pc_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        r.register(_Live(self))
        # Names vLLM renamed and kept for a while as deprecated: its Grafana dashboard
        # (examples/online_serving/prometheus_grafana/grafana.json) still queries
        # time_per_output_token_seconds, and gpu_cache_usage_perc (a live gauge, below).
        for old, new in (("time_per_output_token_seconds", "inter_token_latency_seconds"),
                         ("gpu_prefix_cache_queries", "prefix_cache_queries"),
                         ("gpu_prefix_cache_hits", "prefix_cache_hits")):
            r.register(_Alias(fams[new], P + old, f"DEPRECATED: use {P}{new} instead (the same samples)."))
        # Not an alias in vLLM: the longest output among a request's n sequences. Here each of
        # n samples is an engine request of its own, so it is request_generation_tokens (as
        # vLLM's design doc says for n = 1).
        r.register(_Alias(fams["request_generation_tokens"], P + "request_max_num_generation_tokens",
                          f"(vLLM: of the longest of a request's n sequences; each sample is a request of its "
                          f"own here, so the same samples as {P}request_generation_tokens)"))

    # ---- the scheduling thread -------------------------------------------
    def on_round(self, dur_ns: int, prefill_tokens: int, sampled: int) -> None:
        self._cycles.append(dur_ns)
        self.prompt_tokens += prefill_tokens
        self.generation_tokens += sampled

    # ---- the sender thread (an OutputSink) ----------------------------------
    def on_text(self, request_id: str, text: str) -> None:
        if len(self._cycles) > 4096:
            self._fold()

    def on_finish(self, r: FinishedRecord, text: str) -> None:
        stopped = r.finish_reason == "aborted" and r.finish_detail == STOP_MATCHED
        self.success["stop" if stopped else FINISH_REASON.get(r.finish_reason, "error")].inc()
        self.preemptions.inc(r.num_preemptions)
        self.prompt_hist.observe(len(r.input_ids))
        self.gen_hist.observe(len(r.output_ids))
        if r.finish_reason == "rejected":
            return
        self.pc_queries.inc(len(r.input_ids))
        self.pc_hits.inc(r.cached_prefix_len)
        s = 1e-9
        self.e2e.observe((r.finish_ns - r.arrival_ns) * s)
        if r.admitted_ns:
            self.queue.observe(max(r.admitted_ns - r.queued_ns, 0) * s)
        if r.first_scheduled_ns:
            self.inference.observe((r.finish_ns - r.first_scheduled_ns) * s)
        if r.first_token_ns:
            self.ttft.observe((r.first_token_ns - r.arrival_ns) * s)
            if r.first_scheduled_ns:
                self.prefill.observe((r.first_token_ns - r.first_scheduled_ns) * s)
            self.decode.observe((r.finish_ns - r.first_token_ns) * s)
            if len(r.output_ids) > 1:
                self.tpot.observe((r.finish_ns - r.first_token_ns) * s / (len(r.output_ids) - 1))
        for a, b in zip(r.token_ns, r.token_ns[1:], strict=False):
            self.itl.observe((b - a) * s)

    def _fold(self) -> None:
        q = self._cycles
        while q:
            try:
                self.cycle.observe(q.popleft() * 1e-9)
            except IndexError:  # another thread folded the last one
                return

    def render(self) -> bytes:
        self._fold()
        return generate_latest(self.registry)


class _Live(Collector):
    """Values read from the engine at scrape time."""

    def __init__(self, m: ServerMetrics) -> None:
        self._m = m

    def collect(self) -> Iterator[Any]:
        m, e = self._m, self._m.engine
        if e is None:
            return
        lab = list(m._labels)

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=LABELS)
            g.add_metric(lab, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=LABELS)
            c.add_metric(lab, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", len(e.rm.running))
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", len(e.rm.waiting))
        usage = e.mm.num_used / max(e.mm.num_blocks, 1)
        yield gauge("kv_cache_usage_perc", "KV blocks in use (1 = all).", usage)
        yield gauge("gpu_cache_usage_perc", f"KV blocks in use (1 = all). DEPRECATED: use {P}kv_cache_usage_perc "
                    "instead (the same value).", usage)
        yield counter("prompt_tokens", "Prefill tokens computed.", m.prompt_tokens)
        yield counter("generation_tokens", "Tokens sampled.", m.generation_tokens)
        yield counter("stalls", "Waits the watchdog reported past their timeout (mstrace; not in vLLM).",
                      len(e.stalls.reports))


class _Alias(Collector):
    """`source`'s samples again under another name (the old name of a renamed metric); its
    HELP is the source's and `note`."""

    def __init__(self, source: Collector, name: str, note: str) -> None:
        self._source, self._name, self._note = source, name, note

    def collect(self) -> Iterator[Metric]:
        for fam in self._source.collect():
            out = Metric(self._name, f"{fam.documentation} {self._note}", fam.type, fam.unit)
            # a sample's name is its family's plus a suffix (_bucket, _sum, _count, _total, _created)
            out.samples = [x._replace(name=self._name + x.name[len(fam.name):]) for x in fam.samples]
            yield out
