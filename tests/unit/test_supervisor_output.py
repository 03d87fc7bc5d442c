"""A member's output never blocks it: the supervisor drains its pipe whatever the daemon's own
output does (here a pipe nobody reads, as when the daemon's parent stops reading it)."""

from __future__ import annotations

import os
import sys
import time

from crosspool.cpus import host_cpus
from crosspool.daemon.supervisor import OUTPUT_BACKLOG, Supervisor
from crosspool.ipc import EngineFiles

CHATTY = "import sys\nfor i in range({n}):\n    print('line', i, 'x' * 200)\nsys.stdout.flush()\n"


def test_a_member_outruns_a_sink_nobody_reads():
    read_end, write_end = os.pipe()
    sink = os.fdopen(write_end, "w")
    supervisor = Supervisor("crosspool-test-output-", EngineFiles.now())
    try:
        lines = 2 * OUTPUT_BACKLOG  # ~4 MiB: far past a pipe's 64 KiB buffer
        member = supervisor.start(
            "chatty",
            [sys.executable, "-c", CHATTY.format(n=lines)],
            dict(os.environ),
            member=("front", "front"),
            stop_order=0,
            cpus=host_cpus()[:1],
            sink=sink,
        )
        deadline = time.monotonic() + 30
        while member.proc.poll() is None:
            assert time.monotonic() < deadline, "the member blocked on its output"
            time.sleep(0.05)
        assert member.proc.returncode == 0
    finally:
        supervisor.stop_all(grace_s=5)
        os.close(read_end)  # the writer thread's next print fails and ends it
