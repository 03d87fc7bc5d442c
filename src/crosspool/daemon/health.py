"""The daemon's probe of the engines' HTTP servers while they serve: a process that exists but
does not answer (stopped, deadlocked, starved) holds every request sent to it, so "alive" means
"answered lately". A background thread asks each engine's liveness URL (the integration's
LIVENESS_PATH) every PROBE_INTERVAL_S, each request bounded by PROBE_TIMEOUT_S; the watch loop
reads how long each has been silent."""

from __future__ import annotations

import threading
import time

import httpx

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0


class EngineProbe:
    def __init__(self, urls: dict[str, str]) -> None:
        """`urls`: model id -> the liveness URL of the Instance's own HTTP server."""
        self.urls = urls
        self.last_ok = {model: time.monotonic() for model in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crosspool-engine-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
            while not self._stop.wait(PROBE_INTERVAL_S):
                for model, url in self.urls.items():
                    try:
                        ok = client.get(url).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        self.last_ok[model] = time.monotonic()

    def silent(self, bound_s: float, skip: set[str]) -> tuple[str, float] | None:
        """The first engine not in `skip` (restarting) that has not answered its liveness URL for
        more than `bound_s`, and for how long."""
        now = time.monotonic()
        for model, seen in self.last_ok.items():
            if model not in skip and now - seen > bound_s:
                return model, now - seen
        return None

    def restarted(self, model: str) -> None:
        """The Instance serves again: its silence counts from now."""
        self.last_ok[model] = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + PROBE_INTERVAL_S)


class StepWatch:
    """A stalled step: an engine whose HTTP server answers and whose ranks still beat (a thread
    each) can hold requests without computing (a stopped or deadlocked scheduler or EngineCore).
    An Instance computing makes layer calls; one with requests at its engine and no new layer
    call for the bound has stalled. The clock starts when requests are waiting and restarts with
    every call, so an idle Instance never stalls."""

    def __init__(self) -> None:
        self.since: dict[str, tuple[int, float]] = {}  # model -> (layer calls seen, when they last moved)

    def stalled(self, calls: dict[str, int], waiting: dict[str, int], bound_s: float) -> tuple[str, float, int] | None:
        """The first model with requests waiting (`waiting`, from the front) whose layer-call count
        (`calls`: the models watched) has not moved for more than `bound_s`: (model, seconds, requests waiting)."""
        now = time.monotonic()
        for model in [m for m in self.since if m not in calls]:  # restarting: its clock starts anew
            del self.since[model]
        for model, count in calls.items():
            seen, moved = self.since.get(model, (None, now))
            if count != seen or not waiting.get(model):
                self.since[model] = (count, now)
            elif now - moved > bound_s:
                return model, now - moved, waiting[model]
        return None
