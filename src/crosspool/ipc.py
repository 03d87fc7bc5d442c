"""Shared-memory segments, process-shared semaphores and peer liveness: the primitives Transport
and Fabric stand on.

Segments are plain files in /dev/shm (no multiprocessing.resource_tracker, which unlinks
segments behind the back of attaching processes). Waiters block on a semaphore in the segment
(after watching the words for a while where the plan says so); every wait is sliced so liveness
checks run while blocked.
x86-64 keeps stores in program order (TSO), so "write payload, then publish a sequence
word" is enough between processes; other architectures would need explicit fences.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import select
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from crosspool import envs

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "crosspool-"
# Files engines leave in /dev/shm when their processes are killed (docs/engines.md, leftovers): multiprocessing
# semaphores and shared memory, vLLM's CPU tensor-parallel buffers, SGLang's load snapshots and message queues.
ENGINE_LEFTOVERS = ("sem.mp-", "psm_", "vllm_dist_", "sglang_", "sgl_shm_")

_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_CLOCK_MONOTONIC = 1
SEM_SIZE = 32  # sizeof(sem_t) on 64-bit glibc


class Semaphore:
    """A process-shared POSIX semaphore living in a segment: many posters, blocking bounded waits.

    glibc's sem_post is an atomic increment plus a futex wake only when someone sleeps, which
    gives the Fabric a multi-producer doorbell without a lock (Python has no shared-memory
    atomics of its own)."""

    def __init__(self, seg: Segment, offset: int, *, create: bool) -> None:
        assert offset % 8 == 0 and offset + SEM_SIZE <= seg.size
        self.seg = seg  # keeps the mapping alive
        self._addr = ctypes.c_void_p(seg.addr + offset)
        self._deadline = _Timespec()
        self._wait_args = (self._addr, _CLOCK_MONOTONIC, ctypes.byref(self._deadline))
        if create and _libc.sem_init(self._addr, 1, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self.post: Callable[[], int] = functools.partial(_libc.sem_post, self._addr)
        """Add one count (a process-shared atomic increment; a wake only if a waiter sleeps)."""

    @property
    def address(self) -> int:
        """Where the `sem_t` lies in this process (for the C ends of a call)."""
        assert self._addr.value is not None
        return self._addr.value

    def wait(self, timeout_s: float) -> bool:
        """Take one count; False if none came within `timeout_s` (or a signal interrupted)."""
        at = time.monotonic() + timeout_s  # CLOCK_MONOTONIC
        self._deadline.tv_sec = int(at)
        self._deadline.tv_nsec = int((at % 1.0) * 1e9)
        return _libc.sem_clockwait(*self._wait_args) == 0

    def try_take(self) -> bool:
        return _libc.sem_trywait(self._addr) == 0


_PR_SET_PDEATHSIG = 1


def supervisor_pid() -> int | None:
    """The daemon that started this process (envs.SUPERVISOR_PID), if one did."""
    pid = os.environ.get(envs.SUPERVISOR_PID)
    return int(pid) if pid else None


SUPERVISOR_DIED = signal.SIGHUP
"""The parent-death signal of members that need to know their daemon died (`die_with_supervisor`)."""
_orphaned = False


def supervisor_gone() -> bool:
    """The daemon that started this process is gone: its death signal came (`die_with_supervisor`
    with `noted`), or this process was re-parented. The parent pid alone says it late: the kernel
    first hands a dying daemon's children to another of its threads still running (seen: an
    AtnAgent read its dead daemon's pid and skipped the cleanup only it could do)."""
    supervisor = supervisor_pid()
    return _orphaned or (supervisor is not None and os.getppid() != supervisor)


def _note_supervisor_died(*_: object) -> None:
    global _orphaned
    _orphaned = True
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_supervisor(*, noted: bool = False) -> None:
    """Get SIGTERM when the supervising `crosspool serve` dies, even by SIGKILL (members are
    in their own sessions, so nothing else would stop them). Only for its direct children.
    `noted` (from the main thread): the death signal is SUPERVISOR_DIED, whose handler records it
    for `supervisor_gone` and then sends this process SIGTERM."""
    supervisor = supervisor_pid()
    if supervisor is None or os.getppid() != supervisor:
        return
    sig = signal.SIGTERM
    if noted:
        signal.signal(SUPERVISOR_DIED, _note_supervisor_died)
        sig = SUPERVISOR_DIED
    _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != supervisor:  # it died before prctl took effect
        os.kill(os.getpid(), sig)


def sigterm_unwinds() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does: a command's with-blocks
    then stop the processes they started (Python's default for SIGTERM exits at once, leaving
    them running)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


class Stop:
    """A stop request that a signal handler may make. Handlers run in the main thread between
    bytecodes, possibly while it holds a lock: `threading.Event.set` in a handler deadlocked an
    FfnAgent whose main thread was inside `Event.wait` (the handler waited for the Event's own
    lock, forever; the agent outlived its daemon). `request` only stores a flag; `wait` polls it."""

    POLL_S = 0.1

    def __init__(self) -> None:
        self._event = threading.Event()
        self._requested = False

    def request(self, *_: object) -> None:
        """Safe in a signal handler (takes no lock)."""
        self._requested = True

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._requested or self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """True once a stop is requested or set, False after `timeout_s` without one."""
        end = time.monotonic() + timeout_s
        while not self.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._event.wait(min(left, self.POLL_S))
        return True


class SegmentMissing(FileNotFoundError):
    """A shared-memory segment to attach to does not exist (never created, or already unlinked)."""


class ShmFull(OSError):
    """/dev/shm cannot hold a segment being created."""


SHM_MARGIN_BYTES = 64 << 20
"""Room left in /dev/shm beyond CrossPool's own segments: the engines' own (vLLM's message queues,
SGLang's and torch's) come and go there too."""


def shm_shortage(needed: int) -> str | None:
    """Why /dev/shm cannot take `needed` more bytes plus `SHM_MARGIN_BYTES` (None: it can)."""
    free = shutil.disk_usage(SHM_DIR).free
    if free >= needed + SHM_MARGIN_BYTES:
        return None
    mib = 1 << 20
    return (
        f"{SHM_DIR} has {free / mib:.0f} MiB free; this deployment's shared memory needs "
        f"{needed / mib:.0f} MiB plus {SHM_MARGIN_BYTES / mib:.0f} MiB for the engines (free space there, "
        f"or give the container a larger /dev/shm, e.g. docker --shm-size)"
    )


class Segment:
    """One named shared-memory segment, mapped read-write; u32 words and tensor views over it."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        assert name.startswith(SHM_PREFIX), name
        self.name = name
        self.path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise SegmentMissing(f"shared-memory segment {name!r} does not exist") from None
        try:
            if create:
                try:  # pages for real now: a full /dev/shm fails here, not as SIGBUS mid-serving
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    self.path.unlink(missing_ok=True)
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise ShmFull(
                            e.errno,
                            f"{SHM_DIR} has no room for segment {name!r} ({size} bytes; "
                            f"{shutil.disk_usage(SHM_DIR).free} free)",
                        ) from None
                    raise
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm).cast("I")
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(anchor)
        del anchor

    def mm_view(self, start: int, end: int) -> memoryview:
        return memoryview(self.mm)[start:end]

    def word_addr(self, index: int) -> int:
        return self.addr + 4 * index

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for dim in shape:
            count *= dim
        view = torch.frombuffer(self.mm, dtype=dtype, count=count, offset=offset)
        return view.view(shape)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def unlink_segments(prefix: str) -> list[str]:
    """Remove every segment whose name starts with `prefix`; returns the names removed."""
    assert prefix.startswith(SHM_PREFIX), prefix
    removed = []
    for path in SHM_DIR.glob(prefix + "*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def _shm_inodes_in_use() -> set[int]:
    """Inodes of /dev/shm files some process has open or mapped (read from /proc). By inode, not
    name: glibc's sem_open maps a temporary file and then links it to the semaphore's name, so
    /proc/PID/maps shows `/dev/shm/sem.XXXXXX (deleted)` for a live `sem.mp-*` semaphore."""
    inodes: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
            maps = (proc / "maps").read_text().splitlines()
        except OSError:  # it ended while being read, or is not ours to read (then it holds none of ours)
            continue
        for fd in fds:
            try:
                if os.readlink(fd).startswith(f"{SHM_DIR}/"):
                    inodes.add(os.stat(fd).st_ino)
            except OSError:  # closed while being read
                continue
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM_DIR}/"):
                inodes.add(int(fields[4]))
    return inodes


def shm_names() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir()}


@dataclass(frozen=True)
class EngineFiles:
    """/dev/shm as it was before engines ran: the engine files (`ENGINE_LEFTOVERS`) that appeared
    since are theirs, and whoever ran the engines removes them once no process maps them. Engines
    killed by signal skip their unlink paths (SGLang stops its own children with SIGKILL)."""

    since: float
    existing: frozenset[str]

    @classmethod
    def now(cls) -> EngineFiles:
        return cls(time.time(), frozenset(shm_names()))

    def leftovers(self) -> list[Path]:
        """Engine files not in `existing`, modified at or after `since` (one second of slack: a
        file system's timestamps are coarser than `time.time()`)."""
        new = [p for p in SHM_DIR.iterdir() if p.name.startswith(ENGINE_LEFTOVERS) and p.name not in self.existing]
        return [p for p in new if _mtime(p) >= self.since - 1]

    def sweep(self) -> list[str]:
        """Remove the leftovers no process has open or mapped any more; returns their names."""
        candidates = self.leftovers()
        in_use = _shm_inodes_in_use() if candidates else set()
        removed = []
        for path in candidates:
            if _inode(path) not in in_use:
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed


def group_running(pgid: int) -> bool:
    """Whether a process of process group `pgid` still runs. Zombies do not count: a process has
    released its mappings before it becomes one (and one whose parent died may stay a zombie
    where nothing reaps it)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while being read
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            return True
    return False


GROUP_GONE_S = 10.0
"""How long a stop waits for the processes of SIGKILLed process groups to be gone."""


def wait_groups_gone(pgids: list[int], timeout_s: float) -> bool:
    """Wait until no process of the groups `pgids` runs (a group's leader being reaped says
    nothing of the others: SIGKILLed engine processes still map their files for a moment)."""
    deadline = time.monotonic() + timeout_s
    while any(group_running(g) for g in pgids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


class Peer:
    """A process this one depends on, watched through a pidfd (exit is seen even while a zombie)."""

    def __init__(self, role: str, name: str, pid: int) -> None:
        self.role, self.name, self.pid = role, name, pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None

    def __str__(self) -> str:
        return f"{self.role} {self.name!r} (pid {self.pid})"

    @property
    def fd(self) -> int:
        """The pidfd (-1: the process was gone when this Peer was made)."""
        return -1 if self._fd is None else self._fd

    def alive(self) -> bool:
        if self._fd is None:
            return False
        ready, _, _ = select.select([self._fd], [], [], 0)
        return not ready


SLICE_S = 0.05
"""A blocked wait wakes at least this often to look at what it cannot be woken for (a peer's exit,
its bound, a stop request)."""


def bind_port(host: str, port: int = 0) -> int:
    """Bind and release `port` (0: any free one) on `host`; returns the port. OSError if taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, port))
        return int(s.getsockname()[1])
