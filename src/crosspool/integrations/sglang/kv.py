"""Elastic KV in SGLang: every TP rank runs its own Scheduler over its own KV pool, fed the same
requests (TP rank 0 receives and broadcasts them), so the ranks make the same decisions on the
same allocator state. A KV Capacity Group is the TP ranks of one Instance; a block is one token
slot (SGLang's CPU page size is 1).

Each rank reserves and zero-fills its whole pool at start (SGLang's own allocation, sized by
kv_cache_gib); the admitted prefix is slots 1..`admitted` (slot 0 is SGLang's padding slot). At
the top of every scheduler iteration, where all ranks run in lockstep (right after SGLang's own
request broadcast), rank 0 reads the daemon's target and broadcasts it; every rank then evicts
prefix-cache entries that hold slots past the target (through the tree's own LRU eviction),
counts the free slots it would withdraw, and the ranks vote (one all-reduce): all withdraw the
same slots and release their pages, or all keep the old capacity. Slots a running request holds
are withdrawn when SGLang frees them (the allocator's `free` drops slots past the target); a
request is never retracted for a shrink. Growing puts withdrawn slots back at the head of the
free list; their pages fault in on first write.

SGLang's scheduler loop polls (it does not block when idle), so no wake-up is needed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from crosspool.kv.backing import block_runs, release
from crosspool.kv.channel import UNFUNDED, GroupReport, KvChannel
from crosspool.plan import KvGroupPlan

CLIP_MAX_NEW_TOKENS = 4096  # what SGLang's admission reserves at most for one request's output


class CapacityVoteError(RuntimeError):
    """The TP ranks of a group would leave different capacities: the Instance fails."""


class ElasticSlots:
    """In one Scheduler (TP rank): the allocator hands out only admitted slots."""

    def __init__(self, scheduler: Any, group: KvGroupPlan, tp_rank: int, tp_size: int) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        self.scheduler, self.group, self.tp_size = scheduler, group, tp_size
        self.leader = tp_rank == 0
        allocator = scheduler.token_to_kv_pool_allocator
        assert type(allocator) is TokenToKVPoolAllocator, f"elastic KV needs page_size 1, not {type(allocator)}"
        assert scheduler.max_total_num_tokens == allocator.size, (scheduler.max_total_num_tokens, allocator.size)
        self.allocator, self.tree = allocator, scheduler.tree_cache
        self.cpu_group = scheduler.tp_cpu_group if tp_size > 1 else None
        pool = allocator.get_kvcache()
        self.buffers: list[torch.Tensor] = [*pool.k_buffer, *pool.v_buffer]
        assert all(b.shape[0] == allocator.size + 1 and b.is_contiguous() for b in self.buffers)
        self.slot_bytes = sum(b.stride(0) * b.element_size() for b in self.buffers)
        self.total = allocator.size
        one_sequence = scheduler.model_config.context_len + 1
        block_bytes = self.slot_bytes * tp_size
        self.floor = min(self.total, max(-(-group.floor_bytes // block_bytes), one_sequence))
        self.channel = KvChannel(group.name, create=False) if self.leader else None
        self.withdrawn = torch.zeros(self.total + 1, dtype=torch.bool)
        self.backed = self.total
        self.unreleased: list[torch.Tensor] = []
        """Slots withdrawn when SGLang freed them, their pages not released yet."""
        self.admitted = self.total
        self.target = self.floor
        self.released_bytes = 0
        self._wrap_allocator()
        self.step()

    # -- allocator -----------------------------------------------------------------------------

    def _wrap_allocator(self) -> None:
        allocator, native_free, native_clear = self.allocator, self.allocator.free, self.allocator.clear

        def free(slots: torch.Tensor) -> None:
            past = slots > self.admitted
            if past.any():
                self._withdraw(slots[past])
                slots = slots[~past]
            native_free(slots)

        def clear() -> None:  # SGLang's flush_cache: every slot is free again
            native_clear()
            self.withdrawn.zero_()
            self.backed = self.total
            self._withdraw_free_tail()

        allocator.free, allocator.clear = free, clear

    def _withdraw(self, slots: torch.Tensor) -> None:
        self.withdrawn[slots] = True
        self.unreleased.append(slots)
        self._set_backed(self.backed - len(slots))

    def _withdraw_free_tail(self) -> None:
        free = self.allocator.free_pages
        past = free > self.admitted
        if past.any():
            self.allocator.free_pages = free[~past]
            self._withdraw(free[past])

    def _set_backed(self, backed: int) -> None:
        """SGLang's idle check counts every slot as free, cached or used: withdrawn ones are none."""
        self.backed = backed
        self.scheduler.invariant_checker.max_total_num_tokens = backed
        # A frozen dataclass; it sizes SGLang's token-usage metrics.
        object.__setattr__(self.scheduler.pool_stats_observer, "max_total_num_tokens", backed)

    # -- capacity ------------------------------------------------------------------------------

    def step(self) -> None:
        """At the top of a scheduler iteration, on every TP rank in lockstep."""
        command = torch.zeros(2, dtype=torch.int64)
        if self.channel is not None:
            pending = self.channel.pending()
            if pending is not None:
                command[0], command[1] = pending
        if self.cpu_group is not None:
            dist.broadcast(command, src=dist.get_global_rank(self.cpu_group, 0), group=self.cpu_group)
        seq, target = int(command[0]), int(command[1])
        if seq:
            self.target = self.floor if target == UNFUNDED else min(max(target, self.floor), self.total)
        if self.target != self.admitted or self.unreleased or self.backed > self.admitted:
            self._reach()
        if seq and self.channel is not None:
            self.channel.applied(seq)
        if self.leader:
            self.publish()

    def _reach(self) -> None:
        target, old = self.target, self.admitted
        if target < self.backed:
            # Cached slots past the target go first (LRU: SGLang evicts no chosen slot); a finished
            # request's tail slots enter the cache too, so this repeats until the tail is free.
            self._evict_past(target)
        # The vote: every rank would withdraw (or admit) the same slots, else none changes.
        free = self.allocator.free_pages
        moving = int((free > target).sum()) if target < old else int(self.withdrawn[old + 1 : target + 1].sum())
        if not self._all_agree(moving):
            raise CapacityVoteError(f"KV group {self.group.name}: the TP ranks disagree on moving {moving} slots")
        self.admitted = target
        if target > old:
            back = torch.nonzero(self.withdrawn[old + 1 : target + 1]).flatten() + old + 1
            self.withdrawn[back] = False
            self.allocator.free_pages = torch.cat((back, self.allocator.free_pages))
            self._set_backed(self.backed + len(back))
            self.scheduler.running_batch.batch_is_full = False  # admission reopens
        else:
            self._withdraw_free_tail()
        self._release()

    def _evict_past(self, target: int) -> None:
        for _ in range(64):
            cached = self.tree.tree_core.walk_for_kv_canary(unlocked_only=True, swa_resident_only=False)
            past = int((cached.slot_indices > target).sum())
            if past == 0:
                return
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            self.tree.evict(EvictParams(num_tokens=past))

    def _release(self) -> None:
        if not self.unreleased:
            return
        slots = torch.cat(self.unreleased).tolist()
        self.unreleased.clear()
        ranges = [
            (buf.data_ptr() + a * stride, (b - a) * stride)
            for buf in self.buffers
            for stride in [buf.stride(0) * buf.element_size()]
            for a, b in block_runs(slots)
        ]
        released = torch.tensor([release(ranges)], dtype=torch.int64)
        if self.cpu_group is not None:
            dist.all_reduce(released, group=self.cpu_group)
        self.released_bytes += int(released[0])

    def _all_agree(self, count: int) -> bool:
        if self.cpu_group is None:
            return True
        votes = torch.tensor([count, -count], dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(votes[0]) == -int(votes[1])

    # -- demand --------------------------------------------------------------------------------

    def publish(self) -> None:
        """The group's report (TP rank 0): what it backs and uses, what its waiting work needs."""
        assert self.channel is not None
        scheduler, allocator = self.scheduler, self.allocator
        running = scheduler.running_batch.reqs
        ratio = scheduler.new_token_ratio_tracker.current
        reserved = sum(
            _output_room(r) * (1.0 if r.sampling_params.ignore_eos else ratio) for r in running if not r.finished()
        )
        room = max(scheduler.max_running_requests - len(running), 0)
        waiting = scheduler.waiting_queue[:room]
        need = sum(r.seqlen + _output_room(r) for r in waiting)
        free = allocator.available_size() + self.tree.evictable_size()
        demand = max(int(need + reserved) - free, 0)
        wall = time.time() - time.perf_counter()  # SGLang stamps arrivals with perf_counter
        slo = self.group.tbt_slo_s
        deadlines = [
            wall + r.time_stats.scheduler_recv_time + (self.group.ttft_slo_s if not r.output_ids else slo)
            for r in waiting
        ]
        backed = self.backed
        self.channel.publish(
            GroupReport(
                block_bytes=self.slot_bytes * self.tp_size,
                total_blocks=self.total,
                floor_blocks=self.floor,
                backed_blocks=backed,
                used_blocks=backed - allocator.available_size() - self.tree.evictable_size(),
                used_tokens=sum(r.seqlen for r in running),
                cached_blocks=self.tree.evictable_size(),
                demand_blocks=demand,
                running=len(running),
                waiting=len(scheduler.waiting_queue),
                released_bytes=self.released_bytes,
                deadline=min(deadlines) if demand and deadlines else 0.0,
            )
        )


def _output_room(request: Any) -> int:
    return min(max(request.sampling_params.max_new_tokens - len(request.output_ids), 0), CLIP_MAX_NEW_TOKENS)


def install(group: KvGroupPlan) -> None:
    """Patch SGLang's Scheduler so that each scheduler of this Instance runs elastic KV."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_parallel

    native_loop = Scheduler.run_event_loop

    def run_event_loop(scheduler: Any) -> None:
        parallel = get_parallel()
        slots = ElasticSlots(scheduler, group, parallel.tp_rank, parallel.tp_size)
        native_ingest = scheduler.ingest_requests

        def ingest_requests(*args: Any, **kwargs: Any) -> Any:
            received = native_ingest(*args, **kwargs)
            slots.step()
            return received

        scheduler.ingest_requests = ingest_requests
        native_loop(scheduler)

    Scheduler.run_event_loop = run_event_loop  # type: ignore[method-assign]
