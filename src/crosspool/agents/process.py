"""What every agent process shares: its command line, registration with the daemon, heartbeats
and orderly stop."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from crosspool.ipc import Stop, die_with_supervisor
from crosspool.member import ControlClient, load_membership


class AgentProcess:
    def __init__(self, role: str, argv: list[str] | None = None) -> None:
        parser = argparse.ArgumentParser(prog=f"crosspool-{role}")
        parser.add_argument("--plan", type=Path, required=True)
        parser.add_argument("--id", required=True)
        args = parser.parse_args(argv)
        self.role, self.id = role, args.id
        self.plan, secret = load_membership(args.plan)
        self.control = ControlClient(self.plan, secret, role, self.id)
        self.stop = Stop()
        self.heartbeat: Callable[[], None] | None = None
        signal.signal(signal.SIGTERM, self.stop.request)
        signal.signal(signal.SIGINT, self.stop.request)
        die_with_supervisor(noted=True)

    def log(self, message: str) -> None:
        print(f"[{self.role} {self.id}] {message}", file=sys.stderr, flush=True)

    def ready(self, heartbeat: Callable[[], None] | None = None) -> None:
        """Register with the daemon (the readiness report). Then heartbeats: `heartbeat` (a
        timestamp in shared memory the daemon reads) from `wait_for_stop`, else HTTP ones."""
        self.control.register()
        self.heartbeat = heartbeat
        if heartbeat is None:
            self.control.start_heartbeats()
        self.log("ready")

    def fail(self, message: str) -> None:
        """A fatal error of this agent: reported to the daemon, logged, then the process exits non-zero."""
        self.log(f"error: {message}")
        self.control.report_failure(f"{self.role} {self.id!r}: {message}")
        self.stop.set()
        os._exit(1)

    def wait_for_stop(self) -> None:
        while not self.stop.wait(self.plan.heartbeat_interval_s):
            if self.heartbeat is not None:
                self.heartbeat()
        self.control.close()
