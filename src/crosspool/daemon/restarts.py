"""When the daemon starts a failed part of a deployment again: `restart = true`, at most
`max_restarts` restarts within `restart_window_s` (an Instance's and a generation's alike), each
after a backoff that doubles with every restart in the window."""

from __future__ import annotations

import threading
import time

from crosspool.config import Deployment

MAX_BACKOFF_S = 60.0


def no_restart(
    d: Deployment, generation: int, failure_kind: str | None, recent_restarts: int, stopping: bool
) -> str | None:
    """Why a failed generation is not followed by the next one (the daemon exits 1), or None.
    `recent_restarts`: the restarts within `restart_window_s`."""
    if not d.restart:
        return "restart = false"
    if generation == 1 and failure_kind == "startup":
        return "the first generation failed to start (a configuration problem, not a member failure)"
    if stopping:
        return "a stop was requested"
    if recent_restarts >= d.max_restarts:
        return f"max_restarts = {d.max_restarts} reached within restart_window_s = {d.restart_window_s:g}"
    return None


def restart_backoff_s(d: Deployment, recent_restarts: int) -> float:
    """How long to wait before the next restart: doubling with each restart in the window."""
    return float(min(MAX_BACKOFF_S, d.restart_backoff_s * 2**recent_restarts))


class RestartBudget:
    """The restarts of the last `restart_window_s`, shared by the generation loop and the
    Instance restarts within a generation (threads of their own)."""

    def __init__(self, d: Deployment) -> None:
        self.d = d
        self._lock = threading.Lock()
        self._times: list[float] = []

    def recent(self) -> int:
        with self._lock:
            now = time.monotonic()
            self._times = [t for t in self._times if now - t < self.d.restart_window_s]
            return len(self._times)

    def backoff_s(self) -> float:
        return restart_backoff_s(self.d, self.recent())

    def take(self) -> None:
        """Count a restart that starts now."""
        with self._lock:
            self._times.append(time.monotonic())
