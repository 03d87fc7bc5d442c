"""AtnAgent process: owns the Transport of its attention device, i.e. the mailboxes of every
Instance rank placed there; creates them before the engines start and unlinks them at the end.

On one host Transport and Fabric share memory, so a rank's publication in its mailbox already is
the Fabric submission: the agent is not on the per-layer path (a hop through it cost ~100 us
per layer call on a 2-core host). Failures reach waiting ranks through the mailbox fence.
"""

from __future__ import annotations

import time

from crosspool.agents.process import AgentProcess
from crosspool.ipc import EngineFiles, supervisor_gone, unlink_segments
from crosspool.transport.mailbox import Mailbox

# How long a daemon-less AtnAgent waits for the engines to let go of their files (SGLang's server took ~9 s).
ENGINES_GONE_S = 30.0


class AtnAgent:
    def __init__(self, proc: AgentProcess) -> None:
        self.proc = proc
        self.engine_files = EngineFiles.now()
        owned = [mb for mb in proc.plan.mailboxes if mb.atn_agent == proc.id]
        self.mailboxes = [
            Mailbox.create(mb.name, mb.max_rows, mb.hidden, mb.dtype, mb.shards, mb.tp, mb.local_rows) for mb in owned
        ]

    def run(self) -> None:
        self.proc.ready()
        try:
            self.proc.wait_for_stop()
        finally:
            for mb in self.mailboxes:
                mb.seg.unlink()
            if supervisor_gone():
                self.clean_up_after_the_daemon()

    def clean_up_after_the_daemon(self) -> None:
        """Nobody else will clean up after members that died with the daemon: the generation's
        segments, and the engines' own leftovers once their processes let go of them (SGLang
        SIGKILLs its children, which never unlink theirs; its server process still maps one)."""
        unlink_segments(self.proc.plan.shm_prefix)
        deadline = time.monotonic() + ENGINES_GONE_S
        while True:
            self.engine_files.sweep()
            if not self.engine_files.leftovers() or time.monotonic() > deadline:
                return
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    proc = AgentProcess("AtnAgent", argv)
    AtnAgent(proc).run()


if __name__ == "__main__":
    main()
