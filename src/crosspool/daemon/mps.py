"""The deployment's private MPS control daemon: several processes on one GPU (ranks and GPU
FfnAgents) share it through MPS, or time-slice (FEASIBILITY.md: a round trip of ~290 us instead
of ~18). Private: its pipe and log directories are the deployment's own, so it neither joins nor
stops a daemon someone else runs; every process of the deployment gets `env`.

The process that starts the daemon must not be one of its clients: `quit` waits for every client
to exit. So a command that uses the GPU runs under it as a child:

    python -m crosspool.daemon.mps COMMAND ...   (e.g. pytest tests/gpu)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
COMMAND_TIMEOUT_S = 10.0


class MpsError(RuntimeError):
    """The MPS control daemon could not be started, did not answer, or did not stop."""


class MpsDaemon:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="crosspool-mps-"))
        self.pipe_dir, self.log_dir = self.root / "pipe", self.root / "log"
        self.pipe_dir.mkdir()
        self.log_dir.mkdir()
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        self.running = False

    def _control(self, command: str | None) -> subprocess.CompletedProcess[str]:
        argv = [CONTROL] if command is not None else [CONTROL, "-d"]
        try:
            return subprocess.run(
                argv,
                input=None if command is None else command + "\n",
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
        except FileNotFoundError:
            raise MpsError(f"{CONTROL} is not on PATH: MPS needs the NVIDIA driver's utilities") from None
        except subprocess.TimeoutExpired:
            raise MpsError(f"{CONTROL} {command or '-d'} did not return within {COMMAND_TIMEOUT_S:.0f} s") from None

    def start(self) -> None:
        done = self._control(None)
        if done.returncode != 0:
            raise MpsError(f"{CONTROL} -d failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        self.running = True
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not self.answers():
            if time.monotonic() > deadline:
                self.stop()
                raise MpsError(f"the MPS control daemon did not answer within {COMMAND_TIMEOUT_S:.0f} s of its start")
            time.sleep(0.05)

    def answers(self) -> bool:
        """Whether the control daemon answers a query (its server list)."""
        return self._control("get_server_list").returncode == 0

    def stop(self) -> None:
        """Quit the control daemon (it stops its server) and remove its directories; bounded."""
        try:
            if self.running:
                self._control("quit")
                deadline = time.monotonic() + COMMAND_TIMEOUT_S
                while self.answers():  # it waits for its clients to exit, then stops answering
                    if time.monotonic() > deadline:
                        raise MpsError(f"the MPS control daemon did not quit within {COMMAND_TIMEOUT_S:.0f} s")
                    time.sleep(0.05)
        finally:
            self.running = False
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> MpsDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every process started on the GPU hosts this was built on."""


def under_mps() -> bool:
    return "CUDA_MPS_PIPE_DIRECTORY" in os.environ


def run_under_mps(argv: list[str]) -> int:
    """Run `argv` with a private MPS control daemon: started before, stopped after (also when it fails)."""
    with MpsDaemon() as mps:
        print(f"crosspool: MPS control daemon started ({mps.pipe_dir})", file=sys.stderr, flush=True)
        try:
            return subprocess.run(argv, env=os.environ | mps.env | NO_MULTICAST).returncode
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m crosspool.daemon.mps COMMAND [ARGS ...]")
    sys.exit(run_under_mps(sys.argv[1:]))
