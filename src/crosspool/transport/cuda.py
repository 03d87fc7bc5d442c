"""The CUDA Transport: one device-memory mailbox per Instance rank, through which its layer calls
reach a GPU FfnAgent with no host synchronisation, so a rank's whole step (every layer call in
it) can be captured in one CUDA graph and replayed.

The rank creates the mailbox on its GPU and hands it to the FfnAgent as a CUDA IPC handle
(`export` / `DeviceMailbox.open`). It holds:
* `input` and `output` planes [max_rows, hidden] in device memory;
* device flag words, one request and one response word per layer (`req(l)`, `resp(l)`);
* a small host shared-memory segment, mapped into both processes' CUDA address space: the step
  doorbell (1 + the rows of the step the rank starts; 0: none), a status word and an error text.

A layer call, enqueued on the caller's current stream (no host work that depends on the device):
the first layer of a step writes the step doorbell (a stream memop into host memory), every layer
copies its rows into `input`, writes `req(l) = 1`, waits for `resp(l) == 1`, writes `resp(l) = 0`
and copies `output` into the caller's tensor. The FfnAgent's host thread sees the doorbell, clears
it and launches its work for the step (a captured graph per row bucket or the same work eagerly):
per layer it waits for `req(l) == 1`, clears it, computes, writes `resp(l) = 1`. Every word goes
back to 0 after use, so the values a captured graph writes and waits for are the same on every
replay, and a layer's words are never reused within a step (no ABA between layers). Stream
memory operations with default flags are preceded by a system-wide memory fence, so a flag seen
means the rows before it are visible.

A dead peer must not hang a captured graph: a device wait has no timeout. The rank's watchdog
thread (and the daemon, through `abort`) writes the failure status and the error into the host
segment and then every response and request word from a side stream, and keeps re-writing them
while the rank's work runs on, so every wait of the graph in flight completes. The rank checks
`raise_if_failed()` before each step it launches (the output of an aborted step is garbage and
must not be used); a call made eagerly checks it too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import threading
from dataclasses import dataclass

import torch
from cuda.bindings import driver as cu

from crosspool.ipc import SHM_PREFIX, SLICE_S, Peer, Segment
from crosspool.transport.errors import FfnAgentFailed, FfnCallRejected, FfnFenced, FfnPeerExited

MAX_LAYERS = 512
HOST_SIZE = 4096
MAGIC = 0xC5DA0001
# u32 words of the host segment; words written by different processes sit on different 64-byte lines.
H_MAGIC, H_LAYERS, H_RANK_PID = 0, 1, 2  # the rank, at creation
H_STEP = 16  # the rank's stream (1 + rows of the step it starts) and the agent's host thread (clears it)
H_AGENT_PID, H_READY = 32, 33  # the agent
H_STATUS, H_ERR_LEN, H_STOP = 48, 49, 50  # whoever fails or stops the mailbox
ERR_OFFSET, ERR_CAPACITY = 1024, 1024

STATUS_OK, STATUS_PEER_EXITED, STATUS_AGENT_ERROR, STATUS_FENCED = 0, 1, 2, 3
_STATUS_ERRORS: dict[int, type[Exception]] = {
    STATUS_PEER_EXITED: FfnPeerExited,
    STATUS_AGENT_ERROR: FfnAgentFailed,
    STATUS_FENCED: FfnFenced,
}


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error."""


def _ok(result: tuple[object, ...], what: str) -> tuple[object, ...]:
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(f"{what}: {err}")
    return result[1:]


def write_word(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Enqueue `*address = value` (u32) on `stream`, after a system-wide fence."""
    _ok(
        cu.cuStreamWriteValue32(
            cu.CUstream(stream.cuda_stream),
            cu.CUdeviceptr(address),
            value,
            cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
        ),
        "cuStreamWriteValue32",
    )


def wait_word(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Enqueue a wait until `*address == value` (u32) on `stream`."""
    _ok(
        cu.cuStreamWaitValue32(
            cu.CUstream(stream.cuda_stream),
            cu.CUdeviceptr(address),
            value,
            cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
        ),
        "cuStreamWaitValue32",
    )


def _make_current(device: int) -> None:
    """Make the device's primary context (torch's) current on this thread: driver calls need one,
    and torch creates and sets it lazily, at its first kernel or allocation there."""
    torch.cuda.init()
    (dev,) = _ok(cu.cuDeviceGet(device), "cuDeviceGet")
    (ctx,) = _ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _register_host(seg: Segment) -> int:
    """Pin the segment's pages and map them into this process's CUDA address space; the device
    address of its first byte."""
    flags = cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE
    _ok(cu.cuMemHostRegister(seg.addr, seg.size, flags), "cuMemHostRegister")
    (dptr,) = _ok(cu.cuMemHostGetDevicePointer(seg.addr, 0), "cuMemHostGetDevicePointer")
    return int(dptr)  # type: ignore[call-overload]


def _unregister_host(seg: Segment) -> None:
    _ok(cu.cuMemHostUnregister(seg.addr), "cuMemHostUnregister")


@dataclass(frozen=True)
class _Layout:
    """What crosses to the FfnAgent (as JSON): the host segment, the device allocation's CUDA IPC
    handle and how the flags and planes sit in it."""

    host_name: str
    ipc_handle: str  # hex
    device: int
    max_rows: int
    hidden: int
    dtype: str

    @property
    def plane_bytes(self) -> int:
        return self.max_rows * self.hidden * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def size(self) -> int:
        return FLAGS_BYTES + 2 * self.plane_bytes


FLAGS_BYTES = 4 * 2 * MAX_LAYERS


class _DeviceArray:
    """A device address range as `__cuda_array_interface__`, for torch.as_tensor to wrap without a copy."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False), "version": 3}


def _wrap(address: int, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
    """A tensor over device memory this module allocated or opened (same-sized integers, viewed as `dtype`)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.as_tensor(_DeviceArray(address, shape, f"<i{size}"), device=torch.device("cuda", device))
    return raw.view(dtype)


class DeviceMailbox:
    """The mailbox of one rank; `create` on the rank's side, `open` on the agent's.

    Its device memory is one driver allocation (`cuMemAlloc`), shared by a CUDA IPC memory handle
    rather than torch's tensor sharing: the lifetime is explicit (the agent closes the handle, the
    rank frees the memory) and nothing is left in /dev/shm (torch's reducer shares an IPC event too,
    whose /dev/shm file the driver left behind under MPS)."""

    def __init__(self, layout: _Layout, host: Segment, address: int, *, owner: bool) -> None:
        self.layout, self.host, self.owner, self.address = layout, host, owner, address
        self.device = torch.device("cuda", layout.device)
        dtype = getattr(torch, layout.dtype)
        self.max_rows, self.hidden = layout.max_rows, layout.hidden
        self.flags = _wrap(address, (2 * MAX_LAYERS,), torch.int32, layout.device)
        planes = (layout.max_rows, layout.hidden)
        self.input = _wrap(address + FLAGS_BYTES, planes, dtype, layout.device)
        self.output = _wrap(address + FLAGS_BYTES + layout.plane_bytes, planes, dtype, layout.device)
        self.layers = host.words[H_LAYERS]
        _make_current(layout.device)
        self.host_dev = _register_host(host)
        self.flags_dev = address
        self._closed = False

    @classmethod
    def create(cls, *, layers: int, max_rows: int, hidden: int, dtype: torch.dtype, device: int) -> DeviceMailbox:
        assert 0 < layers <= MAX_LAYERS, layers
        host = Segment(f"{SHM_PREFIX}cuda-{os.getpid()}-{secrets.token_hex(4)}", HOST_SIZE, create=True)
        address = None
        try:
            host.words[H_LAYERS] = layers
            host.words[H_RANK_PID] = os.getpid()
            host.words[H_MAGIC] = MAGIC
            _make_current(device)
            layout = _Layout(host.name, "", device, max_rows, hidden, str(dtype).removeprefix("torch."))
            (ptr,) = _ok(cu.cuMemAlloc(layout.size), "cuMemAlloc")
            address = int(ptr)  # type: ignore[call-overload]
            (handle,) = _ok(cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
            layout = dataclasses.replace(layout, ipc_handle=bytes(handle.reserved).hex())  # type: ignore[attr-defined]
            _ok(cu.cuMemsetD8(ptr, 0, layout.size), "cuMemsetD8")  # flags and planes start at 0
            _ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            return cls(layout, host, address, owner=True)
        except BaseException:
            if address is not None:
                cu.cuMemFree(cu.CUdeviceptr(address))
            host.unlink()
            raise

    def export(self) -> bytes:
        """The mailbox as bytes another process opens (valid while this process holds the mailbox)."""
        assert self.owner
        return json.dumps(dataclasses.asdict(self.layout)).encode()

    @classmethod
    def open(cls, blob: bytes) -> DeviceMailbox:
        layout = _Layout(**json.loads(blob))
        host = Segment(layout.host_name, HOST_SIZE, create=False)
        assert host.words[H_MAGIC] == MAGIC, layout.host_name
        handle = cu.CUipcMemHandle()
        handle.reserved = bytes.fromhex(layout.ipc_handle)
        _make_current(layout.device)
        flags = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        (ptr,) = _ok(cu.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle")
        return cls(layout, host, int(ptr), owner=False)  # type: ignore[call-overload]

    def req(self, layer: int) -> int:
        return self.flags_dev + 4 * layer

    def resp(self, layer: int) -> int:
        return self.flags_dev + 4 * (MAX_LAYERS + layer)

    @property
    def step_word(self) -> int:
        return self.host_dev + 4 * H_STEP

    # --- status: host memory, read and written by every process of the mailbox

    def status(self) -> int:
        return int(self.host.words[H_STATUS])

    def error(self) -> str:
        n = self.host.words[H_ERR_LEN]
        return bytes(self.host.mm_view(ERR_OFFSET, ERR_OFFSET + n)).decode(errors="replace")

    def raise_if_failed(self) -> None:
        status = self.status()
        if status != STATUS_OK:
            raise _STATUS_ERRORS[status](self.error())

    def fail(self, status: int, reason: str) -> bool:
        """Record the failure (the first one wins); False if the mailbox had failed already."""
        assert status in _STATUS_ERRORS, status
        if self.status() != STATUS_OK:
            return False
        text = reason.encode()[:ERR_CAPACITY]
        self.host.mm_view(ERR_OFFSET, ERR_OFFSET + len(text))[:] = text
        self.host.words[H_ERR_LEN] = len(text)
        self.host.words[H_STATUS] = status
        return True

    def release_waits(self, stream: torch.cuda.Stream) -> None:
        """Write every request and response word from `stream`: each wait in flight on either side completes."""
        for layer in range(self.layers):
            write_word(stream, self.resp(layer), 1)
            write_word(stream, self.req(layer), 1)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _make_current(self.layout.device)
        torch.cuda.synchronize(self.device)  # no stream of this process still uses the memory
        _unregister_host(self.host)
        if self.owner:
            _ok(cu.cuMemFree(cu.CUdeviceptr(self.address)), "cuMemFree")
            self.host.unlink()
        else:
            _ok(cu.cuIpcCloseMemHandle(cu.CUdeviceptr(self.address)), "cuIpcCloseMemHandle")


class RankChannel:
    """The rank's side: `call` is the FfnTransport of `crosspool.ops` for CUDA tensors.

    The first layer of every step must be `first_layer` and a step calls each layer once, in
    order (the decoder's order); the agent runs the layers in that order too."""

    def __init__(self, mailbox: DeviceMailbox, *, first_layer: int = 0) -> None:
        assert mailbox.owner
        self.mailbox, self.first_layer = mailbox, first_layer
        self.dtype = mailbox.input.dtype

    def call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> None:
        box = self.mailbox
        rows = hidden.shape[0]
        if not 0 <= layer < box.layers:
            raise FfnCallRejected(f"layer {layer} is outside the mailbox's {box.layers} layers")
        if rows > box.max_rows or hidden.shape[1] != box.hidden or hidden.dtype != self.dtype:
            raise FfnCallRejected(
                f"layer {layer}: a call of {tuple(hidden.shape)} {hidden.dtype} does not fit the mailbox's "
                f"{box.max_rows} x {box.hidden} {self.dtype}"
            )
        if not torch.cuda.is_current_stream_capturing():
            box.raise_if_failed()
        stream = torch.cuda.current_stream()
        if layer == self.first_layer:
            write_word(stream, box.step_word, rows + 1)
        box.input[:rows].copy_(hidden)
        write_word(stream, box.req(layer), 1)
        wait_word(stream, box.resp(layer), 1)
        write_word(stream, box.resp(layer), 0)
        out.copy_(box.output[:rows])


class Watchdog:
    """Releases the rank's device waits when its FfnAgent exits or someone fails the mailbox, so a
    captured graph in flight completes (with garbage rows; `raise_if_failed` says why)."""

    def __init__(self, mailbox: DeviceMailbox, agent: Peer) -> None:
        self.mailbox, self.agent = mailbox, agent
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(mailbox.device)
        self._thread = threading.Thread(target=self._run, name="crosspool-cuda-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        box = self.mailbox
        _make_current(box.layout.device)  # a new thread has no current context
        while not self._stop.wait(SLICE_S):
            if box.status() == STATUS_OK and not self.agent.alive():
                box.fail(STATUS_PEER_EXITED, f"{self.agent} exited")
            if box.status() != STATUS_OK:
                # Again every slice: the rank clears a response word after each wait, and a step
                # launched before it saw the failure waits on words this pass already wrote.
                box.release_waits(self._stream)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * SLICE_S + 1)
        self._stream.synchronize()
