"""The sweep of engine leftovers in /dev/shm removes what no process holds, and never a live
file: a live multiprocessing semaphore shows in /proc/PID/maps under glibc's temporary name."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

from crosspool.ipc import SHM_DIR, unlink_orphans


def test_live_semaphore_is_kept_and_orphan_removed():
    since = time.time() - 1
    live = multiprocessing.get_context("spawn").Semaphore()  # named until a child opens it
    orphan = "sem.mp-crosspool-test-orphan"
    subprocess.run([sys.executable, "-c", f"open('{SHM_DIR}/{orphan}', 'w').close()"], check=True)
    try:
        assert unlink_orphans(("sem.mp-",), since, set()) == [orphan]
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_acquire_release, args=(live,))  # the child opens it by name
        child.start()
        child.join(60)
        assert child.exitcode == 0
    finally:
        (SHM_DIR / orphan).unlink(missing_ok=True)


def _acquire_release(semaphore) -> None:
    semaphore.acquire()
    semaphore.release()
