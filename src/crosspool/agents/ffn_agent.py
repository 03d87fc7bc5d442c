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
from crosspool.fabric.inbox import COUNTERS, Inbox
from crosspool.integrations import kernels
from crosspool.ipc import SLICE_S
from crosspool.models.spec import load_ffn_spec
from crosspool.plan import MailboxPlan
from crosspool.transport._calls import AgentChannel
from crosspool.transport.mailbox import LAYOUT, PROBE_LAYER, STATUS_ERROR, STATUS_OK, Mailbox


@dataclass
class Served:
    """A mailbox this agent takes calls from, and the layers of its model placed here."""

    plan: MailboxPlan
    mailbox: Mailbox
    layers: dict[int, LayerExecutor]
    shard_of: dict[int, int]  # layer -> this agent's shard index in the layer's execution group


class ProtocolError(RuntimeError):
    pass


class FfnAgent:
    def __init__(self, proc: AgentProcess) -> None:
        self.proc = proc
        plan = proc.plan
        me = next(a for a in plan.ffn_agents if a.id == proc.id)
        self.threads = me.threads
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
        self.inbox = Inbox.create(plan.inbox_name(proc.id), proc.id, len(plan.mailboxes))
        self.served: list[Served] = []
        ends = []
        for mplan in plan.mailboxes:
            if mplan.model in layers:
                mailbox = Mailbox.open(mplan.name)
                self.served.append(Served(mplan, mailbox, layers[mplan.model], shard_of[mplan.model]))
                held = bytes(layer in layers[mplan.model] for layer in range(plan.model(mplan.model).num_layers))
                ends.append((mailbox.seg.addr, self.inbox.counters_address(mplan.index), mailbox.readers, held))
        self.channel = AgentChannel(
            layout=LAYOUT | COUNTERS, doorbell=self.inbox.doorbell.address, served=ends, spin_ns=me.spin_us * 1000
        )
        self.lanes = me.lanes

    def execute(self, index: int, seq: int, layer: int, rows: int, claimed_ns: int) -> None:
        """Compute a claimed call into its output plane and answer it."""
        served = self.served[index]
        mb = served.mailbox
        if layer == PROBE_LAYER:
            self.channel.reply(index, seq, 0, STATUS_OK, 0)
            return
        shard = served.shard_of[layer]
        if rows == 0:  # a call claimed after its mailbox was fenced: answered, not computed
            mb.reply(seq, STATUS_ERROR, f"FfnAgent {self.proc.id!r}: {mb.fence_reason()}", shard)
            return
        try:
            if not 0 < rows <= mb.max_rows:
                raise ProtocolError(f"{rows} rows published; the mailbox holds {mb.max_rows}")
            served.layers[layer](mb.input[:rows], mb.outputs[shard][:rows])
        except Exception as e:
            mb.reply(
                seq, STATUS_ERROR, f"FfnAgent {self.proc.id!r} failed layer {layer} of {served.plan.model}: {e}", shard
            )
            if isinstance(e, ProtocolError):
                raise
        else:
            self.channel.reply(index, seq, shard, STATUS_OK, claimed_ns)

    def lane(self) -> None:
        stop, channel = self.proc.stop, self.channel
        # OpenMP's thread count is per thread: a new thread would compute with the host's default.
        torch.set_num_threads(self.threads)
        try:
            while not stop.is_set():
                call = channel.next_call(SLICE_S)  # the GIL released while it waits
                if call is None:
                    continue
                if len(call) == 4:  # (-1, index, seq, claimed): a sequence number that went backwards
                    _, index, seq, claimed = call
                    raise ProtocolError(
                        f"stale publication in {self.served[index].plan.name}: request {seq} after {claimed}"
                    )
                self.execute(*call)
        except Exception as e:
            self.proc.fail(f"executor lane crashed: {e}")

    def run(self) -> None:
        threads = [threading.Thread(target=self.lane, name=f"lane{i}", daemon=True) for i in range(self.lanes)]
        for t in threads:
            t.start()
        self.inbox.heartbeat()
        self.proc.ready(self.inbox.heartbeat)
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
