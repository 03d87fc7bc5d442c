"""A stop requested by signal handlers ends the wait however many signals arrive and whenever:
`threading.Event.set` in a handler deadlocked a waiting process under a burst of SIGTERMs (20 of
40 children here; an FfnAgent outlived its daemon that way)."""

from __future__ import annotations

import signal
import subprocess
import sys

CHILD = """
import signal
from crosspool.ipc import Stop
stop = Stop()
signal.signal(signal.SIGTERM, stop.request)
print("ready", flush=True)
while not stop.wait(0.001):
    pass
"""


def test_signal_burst_ends_the_wait():
    children = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
    for child in children:
        for _ in range(300):
            if child.poll() is not None:
                break
            child.send_signal(signal.SIGTERM)
    try:
        # Every child ends (a deadlock would time out here). A SIGTERM of the burst that lands after
        # the wait ended, while the interpreter finalizes and has restored the default handler, ends
        # the child by that signal instead of exit code 0.
        codes = [child.wait(timeout=10) for child in children]
        assert set(codes) <= {0, -signal.SIGTERM}, codes
    finally:
        for child in children:
            child.kill()


MEMBER = """
import signal, sys, time
from crosspool.ipc import Stop, die_with_supervisor, supervisor_gone
stop = Stop()
signal.signal(signal.SIGTERM, stop.request)
die_with_supervisor(noted=True)
print("ready", flush=True)
stop.wait(20)
print(supervisor_gone(), flush=True)
"""

SUPERVISOR = """
import os, subprocess, sys, threading
from crosspool import envs
child = []
def start():  # the parent-death signal follows the thread that forked the member
    child.append(subprocess.Popen([sys.executable, "-c", sys.argv[1]], text=True, stdout=subprocess.PIPE,
                                  env={**os.environ, envs.SUPERVISOR_PID: str(os.getpid())}))
    assert child[0].stdout.readline() == "ready\\n"
thread = threading.Thread(target=start)
thread.start()
thread.join()
print(child[0].stdout.readline().strip(), child[0].wait(20), flush=True)
"""


def test_a_member_knows_its_supervisor_died_before_it_is_reparented():
    """The death signal comes while the member's parent pid still names the dying supervisor (here:
    its forking thread ended, the process lives on; a SIGKILLed daemon's threads end one by one)."""
    r = subprocess.run([sys.executable, "-c", SUPERVISOR, MEMBER], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["True", "0"], r.stdout + r.stderr
