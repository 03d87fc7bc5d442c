"""FfnAgent process: holds the FFN weights placed on it and executes layer calls on executor lanes.

Ranks publish calls in their mailboxes and ring this agent's doorbell (its inbox). Each lane is
a thread that wakes on the doorbell, claims the oldest unclaimed call among the mailboxes this
agent serves (FIFO across Instances by submit time), computes it from the mailbox's input plane
and writes the result straight into its output plane. Lanes overlap while torch releases the
GIL; one mailbox never has two calls in flight, so an Instance rank's calls stay serial.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from crosspool.agents.ffn.weights import LayerExecutor, load_layers
from crosspool.agents.process import AgentProcess
from crosspool.fabric.inbox import Inbox
from crosspool.integrations import kernels
from crosspool.ipc import SLICE_S
from crosspool.metrics import MemberMetrics
from crosspool.models.spec import load_ffn_spec
from crosspool.plan import MailboxPlan
from crosspool.transport.mailbox import (
    PROBE_LAYER,
    SEQ_MASK,
    STATUS_ERROR,
    STATUS_OK,
    W_FENCE,
    W_LAYER,
    W_REQ_SEQ,
    W_ROWS,
    Mailbox,
)


@dataclass
class Served:
    """A mailbox this agent takes calls from, and the layers of its model placed here."""

    plan: MailboxPlan
    mailbox: Mailbox
    layers: dict[int, LayerExecutor]
    shard_of: dict[int, int]  # layer -> this agent's shard index in the layer's execution group
    claimed: int  # the last request sequence this agent claimed or saw pass
    executed: int = 0


@dataclass(frozen=True)
class Call:
    served: Served
    seq: int
    layer: int
    rows: int


class ProtocolError(RuntimeError):
    pass


class FfnAgent:
    def __init__(self, proc: AgentProcess) -> None:
        self.proc = proc
        plan = proc.plan
        me = next(a for a in plan.ffn_agents if a.id == proc.id)
        torch.set_num_threads(me.threads)
        start = time.monotonic()
        layers: dict[str, dict[int, LayerExecutor]] = {}
        shard_of: dict[str, dict[int, int]] = {}
        for model in plan.models:
            if mine := model.layers_on(proc.id):
                spec = load_ffn_spec(model.path)
                groups = {layer: model.layer_agents[layer] for layer in mine}
                shards = {layer: (group.index(proc.id), len(group)) for layer, group in groups.items()}
                shard_of[model.id] = {layer: index for layer, (index, _) in shards.items()}
                layers[model.id] = load_layers(
                    spec, model.dtype, model.activation_math, kernels(model.engine), mine, shards
                )
        proc.log(
            f"loaded FFN weights of {sorted(layers)} ({me.weight_bytes / 2**20:.1f} MiB) "
            f"in {time.monotonic() - start:.1f} s"
        )
        self.served = []
        for mplan in plan.mailboxes:
            if mplan.model in layers:
                mailbox = Mailbox.open(mplan.name)
                served = Served(mplan, mailbox, layers[mplan.model], shard_of[mplan.model], mailbox.words[W_REQ_SEQ])
                self.served.append(served)
        self.lanes = me.lanes
        self.inbox = Inbox.create(plan.inbox_name(proc.id), proc.id)
        self._claim_lock = threading.Lock()

    def claim(self) -> Call | None:
        """The oldest published call this agent has not claimed yet, if any."""
        with self._claim_lock:
            while True:
                pending = [s for s in self.served if s.mailbox.words[W_REQ_SEQ] != s.claimed]
                pending = [s for s in pending if not s.mailbox.words[W_FENCE]]
                if not pending:
                    return None
                oldest = min(pending, key=lambda s: s.mailbox.submit_ns())
                w = oldest.mailbox.words
                seq, layer, rows = w[W_REQ_SEQ], w[W_LAYER], w[W_ROWS]
                if w[W_REQ_SEQ] != seq:  # the rank moved on to its next call while we read
                    continue
                if (seq - oldest.claimed) & SEQ_MASK >= 1 << 31:
                    raise ProtocolError(
                        f"stale publication in {oldest.plan.name}: request {seq} after {oldest.claimed}"
                    )
                oldest.claimed = seq
                if layer == PROBE_LAYER or layer in oldest.layers:
                    return Call(oldest, seq, layer, rows)
                # Otherwise the call is for another agent of the model's placement.

    def execute(self, call: Call) -> None:
        mb = call.served.mailbox
        if call.layer == PROBE_LAYER:
            mb.reply(call.seq, STATUS_OK)
            return
        try:
            if not 0 < call.rows <= mb.max_rows:
                raise ProtocolError(f"{call.rows} rows published; the mailbox holds {mb.max_rows}")
            shard = call.served.shard_of[call.layer]
            mb.outputs[shard][: call.rows].copy_(call.served.layers[call.layer](mb.input[: call.rows]))
        except Exception as e:
            model, shard = call.served.plan.model, call.served.shard_of.get(call.layer, 0)
            error = f"FfnAgent {self.proc.id!r} failed layer {call.layer} of {model}: {e}"
            mb.reply(call.seq, STATUS_ERROR, error, shard)
            if isinstance(e, ProtocolError):
                raise
        else:
            mb.reply(call.seq, STATUS_OK, shard=shard)
            call.served.executed += 1

    def metrics(self) -> MemberMetrics:
        executed: dict[str, int] = {}
        for s in self.served:
            executed[s.plan.model] = executed.get(s.plan.model, 0) + s.executed
        pending = sum(
            1 for s in self.served if s.mailbox.words[W_REQ_SEQ] != s.claimed and s.mailbox.words[W_LAYER] in s.layers
        )
        return MemberMetrics(executed=executed, queue_depth=pending)

    def lane(self) -> None:
        stop, doorbell = self.proc.stop, self.inbox.doorbell
        try:
            while not stop.is_set():
                doorbell.wait(SLICE_S)  # also rescans after a slice, so nothing waits on a lost count
                while (call := self.claim()) is not None:
                    self.execute(call)
        except Exception as e:
            self.proc.fail(f"executor lane crashed: {e}")

    def run(self) -> None:
        threads = [threading.Thread(target=self.lane, name=f"lane{i}", daemon=True) for i in range(self.lanes)]
        for t in threads:
            t.start()
        self.proc.ready(self.metrics)
        try:
            self.proc.wait_for_stop()
            # Lanes see the stop within a slice; exiting under a lane still inside a torch op
            # aborted the process ("terminate called without an active exception").
            for t in threads:
                t.join(timeout=5.0)
        finally:
            self.inbox.seg.unlink()


def main(argv: list[str] | None = None) -> None:
    proc = AgentProcess("FfnAgent", argv)
    FfnAgent(proc).run()


if __name__ == "__main__":
    main()
