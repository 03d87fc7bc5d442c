"""The sweep of engine leftovers in /dev/shm removes what no process holds, and never a live
file (a live multiprocessing semaphore shows in /proc/PID/maps under glibc's temporary name);
a stop waits for every process of a killed group, not only its leader."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

from crosspool.ipc import SHM_DIR, EngineFiles, group_running, wait_groups_gone


def test_live_semaphore_is_kept_and_orphan_removed():
    files = EngineFiles.now()
    live = multiprocessing.get_context("spawn").Semaphore()  # named until a child opens it
    orphan = "sem.mp-crosspool-test-orphan"
    subprocess.run([sys.executable, "-c", f"open('{SHM_DIR}/{orphan}', 'w').close()"], check=True)
    try:
        assert files.sweep() == [orphan]
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


def test_a_group_outlives_its_reaped_leader():
    leader = subprocess.Popen(["sh", "-c", "sleep 0.5 & exit 0"], start_new_session=True)
    leader.wait()
    assert group_running(leader.pid)  # its child still runs
    start = time.monotonic()
    assert wait_groups_gone([leader.pid], 10)
    assert time.monotonic() - start > 0.2 and not group_running(leader.pid)
