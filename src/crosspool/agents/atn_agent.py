"""AtnAgent process: owns the mailboxes of every Instance rank on its attention device and turns
each rank request into one Fabric invocation, watching it to completion.

The FfnAgent delivers results straight into the mailbox; this agent stays on the path to turn
a silent or dead FFN side into an error reply naming it, within the plan's ffn_timeout_s.
"""

from __future__ import annotations

import threading
import time

from crosspool.agents.process import AgentProcess
from crosspool.fabric.ring import Ring
from crosspool.ipc import Peer, wait_word_change
from crosspool.plan import MailboxPlan
from crosspool.transport.mailbox import STATUS_ERROR, W_LAYER, W_REQ_SEQ, W_ROWS, Mailbox


class AtnAgent:
    def __init__(self, proc: AgentProcess) -> None:
        self.proc = proc
        plan = proc.plan
        self.owned = [mb for mb in plan.mailboxes if mb.atn_agent == proc.id]
        self.mailboxes = {mb.index: Mailbox.create(mb.name, mb.max_rows, mb.hidden, mb.dtype) for mb in self.owned}
        self.rings: dict[str, Ring] = {}
        self.ffn_peers: dict[str, Peer] = {}
        for ffn in {mb.ffn_agent for mb in self.owned}:
            ring = self.rings[ffn] = Ring.open(plan.ring_name(proc.id, ffn))
            self.ffn_peers[ffn] = Peer("FfnAgent", ffn, ring.ffn_pid)

    def serve_mailbox(self, mplan: MailboxPlan) -> None:
        mb = self.mailboxes[mplan.index]
        ring, ffn = self.rings[mplan.ffn_agent], self.ffn_peers[mplan.ffn_agent]
        w = mb.words()
        timeout_s = self.proc.plan.ffn_timeout_s
        stop = self.proc.stop

        def check_stop() -> None:
            if stop.is_set():
                raise InterruptedError

        def check_ffn() -> None:
            if not ffn.alive():
                raise ConnectionError(f"{ffn} exited")

        seen = w[W_REQ_SEQ]
        try:
            while True:
                seen = wait_word_change(mb.seg, W_REQ_SEQ, seen, deadline=None, check=check_stop)
                layer, rows = w[W_LAYER], w[W_ROWS]
                try:
                    check_ffn()
                    seq = ring.submit(mplan.index, layer, rows, seen)
                    done = ring.done_word(seq)
                    deadline = time.monotonic() + timeout_s
                    while ring.seg.words[done] != seq:
                        # Watching only, for failure: spinning here would take a core from the
                        # FfnAgent and the rank, which are on the call's critical path.
                        wait_word_change(
                            ring.seg, done, ring.seg.words[done], deadline=deadline, check=check_ffn, spin_s=0.0
                        )
                except (ConnectionError, TimeoutError) as e:
                    reason = str(e) or f"FfnAgent {mplan.ffn_agent!r} did not answer within {timeout_s:g} s"
                    mb.reply(seen, STATUS_ERROR, f"FFN pool failed: {reason} during layer {layer} of {mplan.model}")
                    self.proc.log(f"error: {reason} during layer {layer} of {mplan.model}")
        except InterruptedError:
            return
        except Exception as e:
            self.proc.fail(f"mailbox thread for {mplan.model} rank {mplan.rank} crashed: {e!r}")

    def run(self) -> None:
        threads = [threading.Thread(target=self.serve_mailbox, args=(mb,), daemon=True) for mb in self.owned]
        for t in threads:
            t.start()
        self.proc.ready()
        try:
            self.proc.wait_for_stop()
        finally:
            for mb in self.mailboxes.values():
                mb.seg.unlink()


def main(argv: list[str] | None = None) -> None:
    proc = AgentProcess("AtnAgent", argv)
    AtnAgent(proc).run()


if __name__ == "__main__":
    main()
