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
