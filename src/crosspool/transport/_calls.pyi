"""Both ends of a layer call through a shared-memory mailbox (_calls.c)."""

from collections.abc import Sequence

OK: int
FENCED: int
PEER_EXITED: int
TIMEOUT: int
AGENT_ERROR: int
DISAGREE: int
ROWS_DIFFER: int
ROWS_UNOWNED: int
RECEIVE_ONLY: int
N_BUCKETS: int

class RankChannel:
    seq: int
    failed_index: int
    def __init__(
        self,
        *,
        layout: dict[str, int],
        base: int,
        reader: int,
        readers: int,
        hidden: int,
        itemsize: int,
        bf16: bool,
        max_rows: int,
        groups: Sequence[Sequence[int]],
        doorbells: Sequence[int],
        pidfds: Sequence[int],
        bound_ns: int,
        spin_ns: int,
        slice_ns: int,
        buckets_ns: Sequence[int],
        index_offset: int = 0,
    ) -> None: ...
    def call(self, layer: int, in_ptr: int, out_ptr: int, rows: int, index_ptr: int = 0, total: int = 0, /) -> int: ...
    def probe(self, rows: int = 1, /) -> int: ...

class AgentChannel:
    def __init__(
        self,
        *,
        layout: dict[str, int],
        doorbell: int,
        served: Sequence[tuple[int, int, int, bytes]],
        spin_ns: int = 0,
    ) -> None: ...
    def next_call(self, timeout_s: float, /) -> tuple[int, int, int, int, int] | tuple[int, int, int, int] | None: ...
    def reply(self, index: int, seq: int, shard: int, status: int, claimed_ns: int, /) -> None: ...
