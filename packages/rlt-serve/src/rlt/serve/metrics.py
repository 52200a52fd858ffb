"""Prometheus metrics of the server (prometheus-client, one registry per server).

Names follow vLLM's with an ``rlt:`` prefix, so dashboards map over: engine requests by outcome
(``rlt:requests_total{outcome=stop|length|abort|error}``; each of n choices is one engine
request), HTTP requests rejected before reaching the engine (``rlt:requests_rejected_total
{reason}``: bad_request, not_found, overloaded, too_large, timeout, unauthorized), client
disconnects, engine faults, prompt and generated tokens, running / waiting / in-flight requests
and KV usage (read from the engine thread's latest stats snapshot at scrape time), what engine
components report through ``EngineStats.feature_metrics`` (e.g. rlt-kvcache's preemption and
prefix-cache counters, as ``rlt:<name>``), and the latency histograms TTFT, TPOT, ITL, end-to-end
and queue time, plus the exit depth of every generated token (``rlt:token_exit_depth``; sum /
count is the mean) and its running mean.

Times are measured on one monotonic clock: arrival when the front end admits the request, token
times when the engine thread finished the step that produced them.

Must not: read the engine directly (only the stats snapshots it is handed).
"""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the /metrics route
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlt.platform.engine.engine import EngineStats
from rlt.platform.outputs import RequestOutput

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@attrs.define(eq=False)
class RequestTimer:
    """Per engine request: what the histograms need."""

    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    depths_seen: int = 0


class _FeatureMetrics:
    """What engine components report (``EngineStats.feature_metrics``), as ``rlt:<name>``: read from
    the latest stats snapshot at scrape time."""

    def __init__(self, owner: "ServerMetrics") -> None:
        self.owner = owner

    def describe(self) -> list:
        return []  # the names are known only once the engine reports them

    def collect(self):
        stats = self.owner._stats
        for m in (stats.feature_metrics if stats is not None else ()):
            family = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
            metric = family(f"rlt:{m.name}", m.help or m.name, labels=["model_name"])
            metric.add_metric([self.owner.model_name], float(m.value))
            yield metric


class ServerMetrics:
    def __init__(self, model_name: str, num_loops: int) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, model_name
        lab = ["model_name"]
        self.requests = Counter("rlt:requests", "Engine requests by how they ended (stop|length|abort|error).",
                                lab + ["outcome"], registry=r)
        self.rejected = Counter("rlt:requests_rejected",
                                "HTTP requests refused before running "
                                "(bad_request|not_found|overloaded|too_large|timeout|unauthorized).",
                                lab + ["reason"], registry=r)
        self.disconnects = Counter("rlt:client_disconnects", "Requests whose client went away before the end.",
                                   lab, registry=r).labels(m)
        self.faults = Counter("rlt:engine_faults", "Engine faults (each aborted only the requests it touched).",
                              lab, registry=r).labels(m)
        self.prompt_tokens = Counter("rlt:prompt_tokens", "Prompt tokens of admitted engine requests (each of n counts).", lab, registry=r).labels(m)
        self.generation_tokens = Counter("rlt:generation_tokens", "Tokens generated.", lab, registry=r).labels(m)
        self.ttft = Histogram("rlt:time_to_first_token_seconds", "Arrival to first generated token.", lab,
                              buckets=_TTFT, registry=r).labels(m)
        self.tpot = Histogram("rlt:time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).", lab,
                              buckets=_ITL, registry=r).labels(m)
        self.itl = Histogram("rlt:inter_token_latency_seconds", "Gap between successive token outputs.", lab,
                             buckets=_ITL, registry=r).labels(m)
        self.e2e = Histogram("rlt:e2e_request_latency_seconds", "Arrival to finish.", lab,
                             buckets=_E2E, registry=r).labels(m)
        self.queue_time = Histogram("rlt:request_queue_time_seconds", "Engine arrival to first scheduled.", lab,
                                    buckets=_TTFT, registry=r).labels(m)
        self.exit_depth = Histogram("rlt:token_exit_depth", "Loops run for each generated token.", lab,
                                    buckets=tuple(float(d) for d in range(1, num_loops + 1)), registry=r).labels(m)
        self._depth_sum = 0
        self._depth_count = 0
        self._stats: EngineStats | None = None
        self._in_flight = lambda: 0
        self._seen_faults = 0
        g = lambda name, doc: Gauge(name, doc, lab, registry=r).labels(m)  # noqa: E731
        g("rlt:num_requests_running", "Engine requests running.").set_function(
            lambda: self._stats.num_running if self._stats else 0)
        g("rlt:num_requests_waiting", "Engine requests waiting for admission.").set_function(
            lambda: self._stats.num_waiting if self._stats else 0)
        g("rlt:num_requests_in_flight", "Engine requests held by the server (running, waiting, queued).").set_function(
            lambda: self._in_flight())
        g("rlt:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).").set_function(
            lambda: self._stats.kv_usage if self._stats else 0.0)
        g("rlt:mean_exit_depth", "Mean loops per generated token so far.").set_function(
            lambda: self._depth_sum / self._depth_count if self._depth_count else 0.0)
        self.model_name = model_name
        r.register(_FeatureMetrics(self))
        for outcome in ("stop", "length", "abort", "error"):
            self.requests.labels(m, outcome)
        for reason in ("bad_request", "not_found", "overloaded", "too_large", "timeout", "unauthorized"):
            self.rejected.labels(m, reason)

    def bind_in_flight(self, fn) -> None:
        self._in_flight = fn

    # -- events ----------------------------------------------------------------------------------
    def timer(self, arrival: float, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(arrival, prompt_tokens)

    def on_admitted(self, t: RequestTimer) -> None:
        self.prompt_tokens.inc(t.prompt_tokens)

    def on_output(self, t: RequestTimer, out: RequestOutput, stamp: float) -> None:
        new = len(out.token_ids) - t.tokens
        if new > 0:
            if t.first_token is None:
                t.first_token = stamp
                self.ttft.observe(max(0.0, stamp - t.arrival))
            elif t.last_token is not None:
                self.itl.observe(max(0.0, stamp - t.last_token))
            t.last_token = stamp
            t.tokens = len(out.token_ids)
            self.generation_tokens.inc(new)
            for d in out.exit_depths[t.depths_seen:]:
                self.exit_depth.observe(d)
                self._depth_sum += d
                self._depth_count += 1
            t.depths_seen = len(out.exit_depths)
        if out.finished:
            outcome = "error" if out.error else (out.finish_reason or "abort")
            self.requests.labels(self.model_name, outcome).inc()
            self.e2e.observe(max(0.0, stamp - t.arrival))
            if t.tokens > 1 and t.first_token is not None and t.last_token is not None:
                self.tpot.observe((t.last_token - t.first_token) / (t.tokens - 1))
            m = out.metrics
            if m.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def on_failed(self, t: RequestTimer | None) -> None:
        self.requests.labels(self.model_name, "error").inc()

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def on_stats(self, stats: EngineStats, thread_faults: int) -> None:
        self._stats = stats
        total = stats.num_faults + thread_faults
        if total > self._seen_faults:
            self.faults.inc(total - self._seen_faults)
            self._seen_faults = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
