"""Metrics: what members count and the daemon's Prometheus view.

The FFN path counts in shared memory: each Instance rank keeps its calls, their time and a latency
histogram in its mailbox, each FfnAgent its executed calls, compute time, queueing and last claim
per mailbox in its inbox; the daemon reads them when it is scraped (`PoolCounters`). The front
keeps cumulative counters and sends them whole in every heartbeat, so a lost heartbeat loses
nothing; the daemon adds its increase since its previous heartbeat to the deployment totals. All
totals survive generations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field

from crosspool.transport.mailbox import LATENCY_BUCKETS_NS

LATENCY_BUCKETS_S = tuple(ns / 1e9 for ns in LATENCY_BUCKETS_NS)
Count = Annotated[int, Field(ge=0, le=2**53)]
Key = Annotated[str, Field(max_length=64)]


class MemberMetrics(BaseModel):
    """What one member reports in its heartbeats, cumulative since it started."""

    model_config = ConfigDict(extra="forbid")
    requests: dict[Key, dict[Key, Count]] = Field(default_factory=dict, max_length=64)
    """Front: model -> HTTP status class ("2xx", "4xx", "5xx") -> requests."""
    inflight: Count | None = None
    """Front: requests being answered."""
    at_engine: dict[Key, Count] = Field(default_factory=dict, max_length=64)
    """Front: model -> requests sent to its engine and not yet answered in full."""


@dataclass
class CallCounts:
    """Layer calls as Instance ranks saw them: count, total seconds, per latency bucket (+Inf last)."""

    count: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def add(self, other: CallCounts) -> None:
        self.count += other.count
        self.seconds += other.seconds
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]


@dataclass
class ExecCounts:
    """Layer calls as one FfnAgent executed them for one model."""

    executed: int = 0
    execute_s: float = 0.0
    queue_s: float = 0.0

    def add(self, other: ExecCounts) -> None:
        self.executed += other.executed
        self.execute_s += other.execute_s
        self.queue_s += other.queue_s


@dataclass
class PoolCounters:
    """The FFN path's counters of one generation (read from shared memory), or their totals."""

    calls: dict[str, CallCounts] = field(default_factory=dict)
    """model -> its ranks' calls (attention TP followers count the calls they read too)."""
    executed: dict[tuple[str, str], ExecCounts] = field(default_factory=dict)
    """(agent, model) -> what the agent executed for the model."""
    queue_depth: dict[str, int] = field(default_factory=dict)
    """agent -> calls published for it and not claimed yet (a gauge: not added over generations)."""

    def add(self, other: PoolCounters) -> None:
        for model, calls in other.calls.items():
            self.calls.setdefault(model, CallCounts()).add(calls)
        for key, counts in other.executed.items():
            self.executed.setdefault(key, ExecCounts()).add(counts)


class DeploymentMetrics:
    """Totals over members and generations, exposed as a prometheus_client collector."""

    def __init__(self, models: list[str]) -> None:
        self.models = set(models)
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.failures: dict[str, int] = {}
        self.generation = 0
        self.retired = PoolCounters()
        """The FFN path's counters of the generations that ended."""
        self.live: Callable[[], PoolCounters] | None = None
        """Reads the current generation's FFN-path counters from shared memory."""

    def add(self, member: str, previous: MemberMetrics | None, now: MemberMetrics) -> None:
        """Count a member's increase since `previous` (its last heartbeat in this generation)."""
        before = previous or MemberMetrics()
        with self._lock:
            for model, classes in now.requests.items():
                if model in self.models or model == "unknown":
                    old = before.requests.get(model, {})
                    for cls, n in classes.items():
                        key = (model, cls[:3])
                        self.requests[key] = self.requests.get(key, 0) + max(0, n - old.get(cls, 0))

    def attach(self, live: Callable[[], PoolCounters]) -> None:
        """Count the current generation's FFN path from `live`."""
        with self._lock:
            self.live = live

    def retire(self) -> None:
        """The current generation ended: keep its final FFN-path counts in the totals."""
        with self._lock:
            if self.live is not None:
                self.retired.add(self.live())
                self.live = None

    def pool(self) -> PoolCounters:
        """The FFN path's totals, the current generation's included."""
        with self._lock:
            total = PoolCounters()
            total.add(self.retired)
            if self.live is not None:
                live = self.live()
                total.add(live)
                total.queue_depth = live.queue_depth
            return total

    def failed(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def collect(self) -> Iterator[Metric]:
        pool = self.pool()
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
            c = CounterMetricFamily("crosspool_failures", "Generation failures by kind", labels=["kind"])
            for kind, n in sorted(self.failures.items()):
                c.add_metric([kind], n)
            yield c
        h = HistogramMetricFamily(
            "crosspool_ffn_call_seconds", "FFN layer-call round trip seen by Instance ranks", labels=["model"]
        )
        for model in sorted(self.models):
            calls = pool.calls.get(model, CallCounts())
            cumulative, running = [], 0
            for bound, n in zip([*map(str, LATENCY_BUCKETS_S), "+Inf"], calls.buckets, strict=True):
                running += n
                cumulative.append((bound, running))
            h.add_metric([model], cumulative, calls.seconds)
        yield h
        executed = CounterMetricFamily(
            "crosspool_ffn_executed", "FFN layer calls executed by an FfnAgent", labels=["agent", "model"]
        )
        execute = CounterMetricFamily(
            "crosspool_ffn_execute_seconds", "Time FfnAgents spent computing layer calls", labels=["agent", "model"]
        )
        queued = CounterMetricFamily(
            "crosspool_ffn_queue_seconds",
            "Time layer calls waited from their publication to an FfnAgent lane claiming them",
            labels=["agent", "model"],
        )
        for (agent, model), counts in sorted(pool.executed.items()):
            executed.add_metric([agent, model], counts.executed)
            execute.add_metric([agent, model], counts.execute_s)
            queued.add_metric([agent, model], counts.queue_s)
        yield executed
        yield execute
        yield queued
        g = GaugeMetricFamily("crosspool_agent_queue_depth", "FFN calls waiting for a lane", labels=["agent"])
        for agent, n in sorted(pool.queue_depth.items()):
            g.add_metric([agent], n)
        yield g
