"""Backing of a reserved KV range on CPU: the address range stays (the engine's tensors keep
their addresses), the pages of withdrawn blocks go back to the OS with madvise(MADV_DONTNEED)
and fault in again, zeroed, when an admitted block is next written. Engine-neutral: an
integration turns block ids into byte ranges of its own cache layout."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


def block_runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted block ids as half-open runs [first, end)."""
    runs: list[tuple[int, int]] = []
    for block in sorted(block_ids):
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs


def _check(rc: int, call: str, start: int, length: int) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call} of {length} bytes at {start:#x}: {os.strerror(err)}")


def release(ranges: Iterable[tuple[int, int]]) -> int:
    """Give the whole pages inside each (address, length) back to the OS; the bytes released:
    those that were resident (a block admitted but never written has no pages to give back).
    Pages shared with a neighbouring range stay (an admitted block may live there)."""
    released = 0
    for addr, length in ranges:
        start = -(-addr // PAGE) * PAGE
        end = (addr + length) // PAGE * PAGE
        if end <= start:
            continue
        resident = ctypes.create_string_buffer((end - start) // PAGE)
        _check(_libc.mincore(start, end - start, resident), "mincore", start, end - start)
        _check(_libc.madvise(start, end - start, MADV_DONTNEED), "madvise(MADV_DONTNEED)", start, end - start)
        released += (len(resident.raw) - resident.raw.count(0)) * PAGE  # mincore: 1 per resident page
    return released


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for process {pid}")
