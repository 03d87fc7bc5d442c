"""What every agent process shares: its command line, readiness report and orderly stop."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from crosspool.ipc import die_with_supervisor
from crosspool.plan import Plan


class AgentProcess:
    def __init__(self, role: str, argv: list[str] | None = None) -> None:
        parser = argparse.ArgumentParser(prog=f"crosspool-{role}")
        parser.add_argument("--plan", type=Path, required=True)
        parser.add_argument("--id", required=True)
        parser.add_argument("--ready-fd", type=int, default=-1)
        args = parser.parse_args(argv)
        self.role, self.id = role, args.id
        self.plan = Plan.model_validate_json(args.plan.read_text())
        self._ready_fd = args.ready_fd
        self.stop = threading.Event()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        die_with_supervisor()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop.set()

    def log(self, message: str) -> None:
        print(f"[{self.role} {self.id}] {message}", file=sys.stderr, flush=True)

    def ready(self) -> None:
        if self._ready_fd >= 0:
            os.write(self._ready_fd, b"ready\n")
            os.close(self._ready_fd)
        self.log("ready")

    def fail(self, message: str) -> None:
        """A fatal error of this agent: logged, then the process exits non-zero."""
        self.log(f"error: {message}")
        self.stop.set()
        os._exit(1)

    def wait_for_stop(self) -> None:
        while not self.stop.wait(0.5):
            pass
