"""The daemon's stalled-step rule (daemon/health.py StepWatch): requests waiting at an engine
whose ranks make no layer call for the bound; an idle Instance, or one whose calls move, never
stalls."""

from __future__ import annotations

import time

from crosspool.daemon.health import StepWatch

BOUND_S = 0.05


def test_waiting_requests_without_a_layer_call_stall_after_the_bound():
    watch = StepWatch()
    assert watch.stalled({"a": 7, "b": 3}, {"a": 2}, BOUND_S) is None
    time.sleep(2 * BOUND_S)
    stalled = watch.stalled({"a": 7, "b": 3}, {"a": 2}, BOUND_S)
    assert stalled is not None and stalled[0] == "a" and stalled[1] > BOUND_S and stalled[2] == 2


def test_an_idle_instance_or_one_that_calls_never_stalls():
    watch = StepWatch()
    for calls in range(4):  # a call between looks: the clock restarts
        assert watch.stalled({"a": calls}, {"a": 1}, BOUND_S) is None
        time.sleep(2 * BOUND_S)
    idle = StepWatch()
    assert idle.stalled({"a": 5}, {}, BOUND_S) is None
    time.sleep(2 * BOUND_S)
    assert idle.stalled({"a": 5}, {"a": 0}, BOUND_S) is None
    assert idle.stalled({"a": 5}, {"a": 1}, BOUND_S) is None  # waiting starts the clock now, not at the last call
