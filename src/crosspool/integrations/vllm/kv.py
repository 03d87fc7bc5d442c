"""Elastic KV in vLLM: the EngineCore's scheduler is the one place that decides for all the TP
ranks of a DP rank, so a KV Capacity Group is one EngineCore.

Each worker reserves and zero-fills its whole KV range at start (vLLM's own allocation, sized
by kv_cache_gib); the EngineCore then withdraws every block past the group's floor from the
BlockPool and has the workers release their pages. Between steps (vLLM's CPU steps are
synchronous: nothing is in flight while the scheduler runs) it applies the daemon's target:
growing puts withdrawn tail blocks back in the free queue (their pages fault in on first write);
shrinking withdraws the tail blocks that are free, evicting their prefix-cache entries through
the BlockPool's own eviction, and releases their pages on every worker through collective_rpc
(all ranks release, or the RPC fails and the Instance with it). Tail blocks a running request
holds stay until it frees them: a request is never preempted for a shrink.

An idle EngineCore blocks on its input queue; a thread waiting on the channel's semaphore wakes
it with vLLM's own WAKEUP request, on which the capacity is applied.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from crosspool.kv.backing import block_runs, release
from crosspool.kv.channel import UNFUNDED, GroupReport, KvChannel
from crosspool.plan import KvGroupPlan

RPC_TIMEOUT_S = 30.0
WAKE_SLICE_S = 1.0


def kv_layout(worker: Any) -> tuple[int, int]:
    """In a worker: (blocks, bytes per block) of its KV allocation."""
    config = worker.model_runner.kv_cache_config
    sizes = {t.size for t in config.kv_cache_tensors}
    assert len(sizes) == 1, "vLLM places every KV cache tensor in one allocation"
    return config.num_blocks, sizes.pop() // config.num_blocks


def release_blocks(worker: Any, runs: list[tuple[int, int]]) -> int:
    """In a worker: release the pages of the blocks in `runs` ([first, end) ids) in every layer;
    the bytes released. Layer l of block b lies at offset + l * layer_stride + b * block_stride."""
    runner = worker.model_runner
    storage = runner.kv_caches[0].untyped_storage()
    base, size = storage.data_ptr(), storage.nbytes()
    ranges: set[tuple[int, int]] = set()
    for t in runner.kv_cache_config.kv_cache_tensors:
        layers = len(t.layers)
        if t.layer_stride < t.block_stride:  # block-outermost: a block packs all layers' pages
            assert t.block_stride == layers * t.layer_stride, (t.block_stride, t.layer_stride, layers)
            ranges.update((t.offset + a * t.block_stride, (b - a) * t.block_stride) for a, b in runs)
        else:  # layer-outermost: per layer, consecutive blocks are adjacent
            ranges.update(
                (t.offset + layer * t.layer_stride + a * t.block_stride, (b - a) * t.block_stride)
                for layer in range(layers)
                for a, b in runs
            )
    assert all(start >= 0 and start + length <= size for start, length in ranges), "block outside the KV allocation"
    return release((base + start, length) for start, length in sorted(ranges))


class ElasticBlocks:
    """In the EngineCore: the group's BlockPool holds only its admitted blocks."""

    def __init__(self, core: Any, group: KvGroupPlan) -> None:
        self.core, self.group = core, group
        self.channel = KvChannel(group.name, create=False)
        scheduler = core.scheduler
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.block_size: int = scheduler.block_size
        self.total = self.pool.num_gpu_blocks
        layouts = core.collective_rpc(kv_layout, timeout=RPC_TIMEOUT_S)
        assert all(blocks == self.total for blocks, _ in layouts), (layouts, self.total)
        self.block_bytes = sum(per_block for _, per_block in layouts)
        one_sequence = -(-core.vllm_config.model_config.max_model_len // self.block_size) + 1  # + the null block
        self.floor = min(self.total, max(-(-group.floor_bytes // self.block_bytes), one_sequence))
        self.withdrawn: set[int] = set()
        self.released_bytes = 0
        self.target = self.floor
        self.seq = 0
        self.blocked_since: dict[str, float] = {}
        self.pool.get_usage = self.usage  # vLLM's log line and kv_cache_usage_perc: of the backed blocks
        self._reach(self.floor)
        self.publish()

    def usage(self) -> float:
        backed = self.total - len(self.withdrawn) - 1  # less the null block, as vLLM counts
        return 1.0 - self.pool.get_num_free_blocks() / backed if backed > 0 else 0.0

    # -- capacity ------------------------------------------------------------------------------

    def apply(self) -> None:
        """Move towards the daemon's latest target (between steps)."""
        pending = self.channel.pending()
        if pending is not None:
            self.seq, target = pending
            self.target = self.floor if target == UNFUNDED else max(target, self.floor)
        elif self.total - len(self.withdrawn) == self.target:
            return
        if self._reach(self.target):
            self.channel.applied(self.seq)

    def _reach(self, target: int) -> bool:
        """Admit withdrawn blocks below `target`, withdraw the free ones from `target` on; whether
        the group now backs exactly `target` blocks."""
        pool = self.pool
        back = sorted(b for b in self.withdrawn if b < target)
        self.withdrawn.difference_update(back)
        # At the head of the free queue: used before free blocks that still hold prefix-cache entries.
        pool.free_block_queue.prepend_n([pool.blocks[b] for b in back])
        taken = []
        for block_id in range(target, self.total):
            block = pool.blocks[block_id]
            if block_id in self.withdrawn or block.ref_cnt > 0 or block.prev_free_block is None:
                continue  # withdrawn already, in use, or the null block (never in the free queue)
            # A prefix-cache hit would take it out of the free queue again: evict its entries first.
            pool._maybe_evict_cached_block(block)
            pool.free_block_queue.remove(block)
            self.withdrawn.add(block_id)
            taken.append(block_id)
        if taken:
            released = self.core.collective_rpc(release_blocks, timeout=RPC_TIMEOUT_S, args=(block_runs(taken),))
            self.released_bytes += sum(released)
        return self.total - len(self.withdrawn) == target

    # -- demand --------------------------------------------------------------------------------

    def publish(self) -> None:
        """The group's report: what it backs and uses, and what its blocked work needs by when."""
        scheduler, pool = self.scheduler, self.pool
        free = pool.get_num_free_blocks()
        backed = self.total - len(self.withdrawn)
        room = max(scheduler.max_num_running_reqs - len(scheduler.running), 0)
        now = time.time()
        need, deadline, blocked = 0, 0.0, set()
        waiting = itertools.chain(scheduler.kv_holding_waiting, scheduler.waiting)
        for request in itertools.islice(waiting, room):
            need += -(-(request.num_tokens + 1) // self.block_size)
            if request.num_output_tokens == 0:
                due = request.arrival_time + self.group.ttft_slo_s
            else:  # preempted while decoding: due one token interval after it was first seen waiting
                due = self.blocked_since.setdefault(request.request_id, now) + self.group.tbt_slo_s
            blocked.add(request.request_id)
            deadline = due if deadline == 0 else min(deadline, due)
        demand = max(need - free, 0)
        self.blocked_since = {r: t for r, t in self.blocked_since.items() if r in blocked}
        self.channel.publish(
            GroupReport(
                block_bytes=self.block_bytes,
                total_blocks=self.total,
                floor_blocks=self.floor,
                backed_blocks=backed,
                used_blocks=backed - 1 - free,
                used_tokens=sum(r.num_computed_tokens for r in scheduler.running),
                cached_blocks=len(pool.cached_block_hashes_by_block),
                demand_blocks=demand,
                running=len(scheduler.running),
                waiting=len(scheduler.waiting) + len(scheduler.kv_holding_waiting),
                released_bytes=self.released_bytes,
                deadline=deadline if demand else 0.0,
            )
        )


def install(group_of: Any) -> None:
    """Patch vLLM's EngineCore loops so that each EngineCore whose group
    `group_of(data_parallel_index)` names (a KvGroupPlan, or None) runs elastic KV."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

    def with_elastic(native_loop: Any) -> Any:
        def run_busy_loop(core: Any) -> None:
            group = group_of(core.vllm_config.parallel_config.data_parallel_index)
            if group is not None:
                _elastic(core, ElasticBlocks(core, group), EngineCoreRequestType.WAKEUP)
            native_loop(core)

        return run_busy_loop

    for cls in (EngineCoreProc, DPEngineCoreProc):  # the DP loop is its own method
        cls.run_busy_loop = with_elastic(cls.run_busy_loop)  # type: ignore[method-assign]


def _elastic(core: Any, blocks: ElasticBlocks, wakeup: Any) -> None:
    step, handle = core.step_fn, core._handle_client_request

    def step_elastic() -> Any:
        blocks.apply()  # a grow serves this step already
        outputs = step()
        blocks.apply()  # finished requests may have freed tail blocks a shrink waits for
        blocks.publish()
        return outputs

    def handle_elastic(request_type: Any, request: Any) -> None:
        if request_type == wakeup:
            blocks.apply()
            blocks.publish()
        handle(request_type, request)

    def wake_on_command() -> None:
        while True:
            if blocks.channel.wake.wait(WAKE_SLICE_S):
                core.input_queue.put_nowait((wakeup, None))

    core.step_fn, core._handle_client_request = step_elastic, handle_elastic
    threading.Thread(target=wake_on_command, name="crosspool-kv-wake", daemon=True).start()
