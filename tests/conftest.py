"""Shared fixtures: tiny checkpoints (fixed seed), the real SmolLM2 checkpoint, leak checks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Set
from pathlib import Path

import pytest

from crosspool import envs
from crosspool.ipc import SHM_DIR

CACHE = envs.cache_root()


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from crosspool.models.prepare import TINY_FAMILIES, make_tiny_checkpoint

    root = CACHE / "tiny"
    return {f: make_tiny_checkpoint(f, root / f"tiny-{f}", seed=0) for f in TINY_FAMILIES}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from crosspool.models.prepare import prepare_smollm2

    return prepare_smollm2()


@contextlib.contextmanager
def frozen(pid: int, timeout_s: float = 5.0) -> Iterator[None]:
    """SIGSTOP `pid` and wait until every one of its threads is stopped; SIGCONT after.

    kill(SIGSTOP) returns before a multithreaded process stops: the kernel wakes one thread
    (the main one), which stops the others once it runs. Until then a thread woken by other
    means runs on: an FfnAgent lane woken by the doorbell answered a call made right after
    kill() in 3 of 30 tries here, and in every try on an AMX Xeon host."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while not all(_thread_state(pid, t) in "tT" for t in os.listdir(f"/proc/{pid}/task")):
            assert time.monotonic() < deadline, f"pid {pid} did not stop within {timeout_s} s"
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _thread_state(pid: int, tid: str) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended
        return "T"


def leftover_files() -> set[str]:
    """Every file in /dev/shm (CrossPool's segments and whatever the engines made: CrossPool removes
    what they leave when killed), and socket files in the temporary directory (the engines' ZeroMQ
    ipc:// endpoints, which killed engine processes leave behind)."""
    tmp = Path(tempfile.gettempdir())
    sockets = {str(p) for p in tmp.iterdir() if p.is_socket()}
    return {p.name for p in SHM_DIR.iterdir()} | sockets


def project_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    mine = str(os.getpid())
    return [
        line
        for line in out.splitlines()[1:]
        if (
            "crosspool.agents" in line
            or "crosspool.front" in line
            or "-m crosspool daemon" in line
            or "vllm.entrypoints" in line
            or "VLLM::" in line
            or ("crosspool.integrations." in line and ".offline" in line)
            or "sglang.launch_server" in line
            or "sglang::" in line
        )
        and line.split()[0] != mine
    ]


def assert_nothing_left(files_before: Set[str], wait_s: float, procs_before: Set[str] = frozenset()) -> None:
    """No shm segment or socket file beyond `files_before` and no project process beyond `procs_before` (those of a
    module's shared deployment), once `wait_s` has let them go."""
    deadline = time.monotonic() + wait_s

    def left() -> tuple[set[str], set[str]]:
        return leftover_files() - files_before, set(project_processes()) - procs_before

    while time.monotonic() < deadline and any(left()):
        time.sleep(0.2)
    files, procs = left()
    assert files == set(), f"shared memory or sockets left behind: {sorted(files)}"
    assert procs == set(), f"processes left behind: {sorted(procs)}"


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves a CrossPool shm segment or a project process behind (beyond
    what was there before it: a module's shared deployment)."""
    files, procs = leftover_files(), set(project_processes())
    yield
    assert_nothing_left(files, 20, procs)


@pytest.fixture(scope="session")
def tiny_served(smollm2) -> Path:
    """A tiny random Qwen3 with SmolLM2's tokenizer (and vocabulary): servable over OpenAI HTTP."""
    from crosspool.models.prepare import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3", CACHE / "tiny" / "tiny-qwen3-tok", seed=0, tokenizer=smollm2)


EXAMPLES = Path(__file__).parents[1] / "examples"


def example_text(name: str, port: int, control_port: int) -> str:
    """examples/NAME.toml as shipped, on the given ports."""
    text = (EXAMPLES / f"{name}.toml").read_text()
    text = re.sub(r"(?m)^control_port = \d+.*\n", "", text)
    text = re.sub(r"(?m)^port = \d+.*$", f"port = {port}\ncontrol_port = {control_port}", text)
    assert f"port = {port}" in text, name
    return text


class RunningDaemon:
    """`crosspool daemon FILE` as a user runs it: a child process, its ready line, its stderr."""

    def __init__(self, tmp: Path, text: Callable[[int, int], str], name: str) -> None:
        """`text(port, control_port)`: the deployment file."""
        import sys
        import threading

        from crosspool.ipc import bind_port

        self.port, self.control_port = bind_port("127.0.0.1"), bind_port("127.0.0.1")
        self.file = tmp / f"{name}.toml"
        self.file.write_text(text(self.port, self.control_port))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "crosspool", "daemon", str(self.file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = f"http://127.0.0.1:{self.control_port}"
        line = self.proc.stdout.readline()  # the ready line, or EOF if the daemon failed
        assert line.startswith("crosspool: ready in"), "".join(self.stderr[-40:])

    def status(self) -> dict:
        import httpx

        return httpx.get(self.control + "/status", timeout=5).json()

    def pid_of(self, name: str) -> int:
        return next(m["pid"] for m in self.status()["members"] if m["name"] == name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class LiveDeployment:
    """One deployment shared by a module's tests: `get()` returns it running, and starts it anew
    if an earlier test ended it, so each test passes alone as well as after the others."""

    def __init__(self, tmp: Path, text: Callable[[int, int], str], name: str) -> None:
        self.tmp, self.text, self.name = tmp, text, name
        self.daemon: RunningDaemon | None = None

    def get(self) -> RunningDaemon:
        if self.daemon is None or self.daemon.proc.poll() is not None:
            self.close()
            self.daemon = RunningDaemon(self.tmp, self.text, self.name)
        return self.daemon

    def close(self) -> None:
        if self.daemon is not None:
            try:
                self.daemon.stop()
            finally:
                self.daemon.kill()
            self.daemon = None


def native_and_pooled(deployment_text: str, work: list[list[int]], tokens: int) -> tuple[list, list, int]:
    """Greedy tokens of `work` (one batch) from the deployment's only model, natively and through
    a real FFN pool, side by side on different CPUs; and the layer calls the pool answered."""
    from crosspool.config import parse_deployment
    from crosspool.daemon.daemon import running_pool
    from crosspool.integrations.offline import generate_in_child, side_by_side
    from crosspool.resolve import resolve
    from crosspool.transport.mailbox import W_REQ_SEQ, Mailbox

    d = parse_deployment(deployment_text)
    (m,) = d.model
    limit = d.limits.max_batched_tokens
    with running_pool(resolve(d)) as gen:
        (mailbox_plan,) = gen.plan.mailboxes_of(m.id)
        native, pooled = side_by_side(
            [
                lambda cpus: generate_in_child(m, limit, [work], tokens, None, cpus=cpus),
                lambda cpus: generate_in_child(m, limit, [work], tokens, gen.plan_path, cpus=cpus),
            ]
        )
        calls = Mailbox.open(mailbox_plan.name).words[W_REQ_SEQ]
    return native["runs"][0]["tokens"], pooled["runs"][0]["tokens"], calls


def skip_unless_sglang_path() -> None:
    """Skip, saying why, where CrossPool refuses SGLang's CPU path on this host (config check)."""
    from crosspool.integrations.sglang.launch import host_problems

    problems = host_problems()
    if problems:
        pytest.skip(problems[0])
