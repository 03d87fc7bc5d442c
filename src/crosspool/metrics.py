"""Metrics: what members count (cumulative, sent in heartbeats) and the daemon's Prometheus view.

Members keep cumulative counters and send them whole in every heartbeat, so a lost heartbeat
loses nothing; the daemon adds each member's increase since its previous heartbeat to the
deployment totals, which survive generations.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from typing import Annotated

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field

# FFN layer-call latency buckets (seconds): a one-row round trip is ~20 us, a 2048-row call tens of ms.
LATENCY_BUCKETS_S = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1.0)
Count = Annotated[int, Field(ge=0, le=2**53)]
Key = Annotated[str, Field(max_length=64)]


class LatencyCounts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: Count = 0
    sum_s: float = Field(0.0, ge=0, le=1e12)
    buckets: list[Count] = Field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1), max_length=64)
    """Per bucket (not cumulative), the last one is +Inf."""


class LatencyHistogram:
    """Cumulative FFN call latencies of one process; observe() is cheap (one bisect)."""

    def __init__(self) -> None:
        self.count = 0
        self.sum_s = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1

    def snapshot(self) -> LatencyCounts:
        return LatencyCounts(count=self.count, sum_s=self.sum_s, buckets=list(self.buckets))


class MemberMetrics(BaseModel):
    """What one member reports, cumulative since it started."""

    model_config = ConfigDict(extra="forbid")
    requests: dict[Key, dict[Key, Count]] = Field(default_factory=dict, max_length=64)
    """Front: model -> HTTP status class ("2xx", "4xx", "5xx") -> requests."""
    ffn_calls: dict[Key, LatencyCounts] = Field(default_factory=dict, max_length=64)
    """Instance rank: model -> FFN layer calls and their round-trip latency."""
    executed: dict[Key, Count] = Field(default_factory=dict, max_length=64)
    """FfnAgent: model -> layer calls executed."""
    queue_depth: Count | None = None
    """FfnAgent: calls published and not yet claimed, sampled at the heartbeat."""
    inflight: Count | None = None
    """Front: requests being answered."""


class DeploymentMetrics:
    """Totals over members and generations, exposed as a prometheus_client collector."""

    def __init__(self, models: list[str]) -> None:
        self.models = set(models)
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.ffn_calls = {m: LatencyHistogram() for m in models}
        self.executed: dict[tuple[str, str], int] = {}
        self.queue_depth: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.generation = 0

    def add(self, agent: str, previous: MemberMetrics | None, now: MemberMetrics) -> None:
        """Count a member's increase since `previous` (its last heartbeat in this generation)."""
        before = previous or MemberMetrics()
        with self._lock:
            for model, classes in now.requests.items():
                if model in self.models or model == "unknown":
                    old = before.requests.get(model, {})
                    for cls, n in classes.items():
                        key = (model, cls[:3])
                        self.requests[key] = self.requests.get(key, 0) + max(0, n - old.get(cls, 0))
            for model, counts in now.ffn_calls.items():
                if model not in self.models or len(counts.buckets) != len(LATENCY_BUCKETS_S) + 1:
                    continue
                old_counts = before.ffn_calls.get(model, LatencyCounts())
                total = self.ffn_calls[model]
                total.count += max(0, counts.count - old_counts.count)
                total.sum_s += max(0.0, counts.sum_s - old_counts.sum_s)
                for i, (n, o) in enumerate(zip(counts.buckets, old_counts.buckets, strict=True)):
                    total.buckets[i] += max(0, n - o)
            for model, n in now.executed.items():
                if model in self.models:
                    key = (agent, model)
                    self.executed[key] = self.executed.get(key, 0) + max(0, n - before.executed.get(model, 0))
            if now.queue_depth is not None:
                self.queue_depth[agent] = now.queue_depth

    def failed(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            g = GaugeMetricFamily("crosspool_generation", "Number of the current generation")
            g.add_metric([], self.generation)
            yield g
            c = CounterMetricFamily(
                "crosspool_requests", "Requests answered by the front endpoint", labels=["model", "code"]
            )
            for (model, cls), n in sorted(self.requests.items()):
                c.add_metric([model, cls], n)
            yield c
            h = HistogramMetricFamily(
                "crosspool_ffn_call_seconds", "FFN layer-call round trip seen by Instance ranks", labels=["model"]
            )
            for model, hist in sorted(self.ffn_calls.items()):
                cumulative, running = [], 0
                for bound, n in zip([*map(str, LATENCY_BUCKETS_S), "+Inf"], hist.buckets, strict=True):
                    running += n
                    cumulative.append((bound, running))
                h.add_metric([model], cumulative, hist.sum_s)
            yield h
            c = CounterMetricFamily(
                "crosspool_ffn_executed", "FFN layer calls executed by an FfnAgent", labels=["agent", "model"]
            )
            for (agent, model), n in sorted(self.executed.items()):
                c.add_metric([agent, model], n)
            yield c
            g = GaugeMetricFamily("crosspool_agent_queue_depth", "FFN calls waiting for a lane", labels=["agent"])
            for agent, n in sorted(self.queue_depth.items()):
                g.add_metric([agent], n)
            yield g
            c = CounterMetricFamily("crosspool_failures", "Generation failures by kind", labels=["kind"])
            for kind, n in sorted(self.failures.items()):
                c.add_metric([kind], n)
            yield c
