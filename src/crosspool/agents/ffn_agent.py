"""FfnAgent process: holds the FFN weights placed on it and executes layer calls from its rings.

One executor thread per inbound ring (one ring per AtnAgent): calls of one AtnAgent run in
submission order; results go straight into the caller's mailbox.
"""

from __future__ import annotations

import threading
import time

import torch

from crosspool.agents.ffn.dense import GatedDenseFfn
from crosspool.agents.ffn.weights import load_dense_layers
from crosspool.agents.process import AgentProcess
from crosspool.fabric.ring import W_HEAD, Ring
from crosspool.ipc import wait_word_change
from crosspool.models.spec import load_ffn_spec
from crosspool.transport.mailbox import STATUS_ERROR, STATUS_OK, Mailbox


class FfnAgent:
    def __init__(self, proc: AgentProcess) -> None:
        self.proc = proc
        plan = proc.plan
        me = next(a for a in plan.ffn_agents if a.id == proc.id)
        torch.set_num_threads(me.threads)
        start = time.monotonic()
        self.layers: dict[str, list[GatedDenseFfn]] = {}
        for model_id in me.models:
            model = plan.model(model_id)
            self.layers[model_id] = load_dense_layers(load_ffn_spec(model.path), model.dtype, model.activation_math)
        proc.log(
            f"loaded FFN weights of {me.models} ({me.weight_bytes / 2**20:.1f} MiB) in {time.monotonic() - start:.1f} s"
        )
        self.mailboxes: dict[int, Mailbox] = {}
        self.rings = [Ring.create(plan.ring_name(atn, proc.id)) for atn in plan.atn_agents]

    def _mailbox(self, index: int) -> Mailbox:
        mb = self.mailboxes.get(index)
        if mb is None:
            mb = self.mailboxes[index] = Mailbox.open(self.proc.plan.mailboxes[index].name)
        return mb

    def execute(self, ring: Ring, seq: int) -> None:
        inv = ring.read(seq)
        mplan = self.proc.plan.mailboxes[inv.mailbox]
        mb = self._mailbox(inv.mailbox)
        try:
            layers = self.layers[mplan.model]
            if not 0 <= inv.layer < len(layers):
                raise RuntimeError(f"layer {inv.layer} out of range for {mplan.model} ({len(layers)} layers)")
            mb.output[: inv.rows].copy_(layers[inv.layer](mb.input[: inv.rows]))
        except Exception as e:
            mb.reply(
                inv.call_seq, STATUS_ERROR, f"FfnAgent {self.proc.id!r} failed layer {inv.layer} of {mplan.model}: {e}"
            )
        else:
            mb.reply(inv.call_seq, STATUS_OK)
        ring.complete(seq)

    def serve_ring(self, ring: Ring) -> None:
        done = 0
        stop = self.proc.stop

        def check() -> None:
            if stop.is_set():
                raise InterruptedError

        try:
            while True:
                head = ring.seg.words[W_HEAD]
                if head == done:
                    head = wait_word_change(ring.seg, W_HEAD, done, deadline=None, check=check)
                while done != head:
                    done += 1
                    self.execute(ring, done)
        except InterruptedError:
            return
        except Exception as e:
            self.proc.fail(f"executor for {ring.seg.name} crashed: {e!r}")

    def run(self) -> None:
        threads = [threading.Thread(target=self.serve_ring, args=(r,), daemon=True) for r in self.rings]
        for t in threads:
            t.start()
        self.proc.ready()
        try:
            self.proc.wait_for_stop()
        finally:
            for r in self.rings:
                r.seg.unlink()


def main(argv: list[str] | None = None) -> None:
    proc = AgentProcess("FfnAgent", argv)
    FfnAgent(proc).run()


if __name__ == "__main__":
    main()
