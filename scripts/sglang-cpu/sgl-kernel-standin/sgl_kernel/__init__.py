"""CrossPool STAND-IN for SGLang's ``sgl_kernel`` package (distribution
``crosspool-sgl-kernel-standin``); it contains NO kernels.

SGLang 0.5.23 imports ``sgl_kernel`` at module load even on CPU, but no CPU
build of sgl-kernel / sglang-kernel exists on PyPI (the x86_64 wheels are CUDA
builds that need libcuda/libtorch_cuda and torch 2.14.1). On a CPU without a
registered ``torch.ops.sgl_kernel`` library SGLang takes its native torch paths
for dense models (Qwen3, Llama) and never calls these kernels.

Every attribute other than the few below is a stub function (made on first
look-up by the module-level ``__getattr__``) that raises :class:`SglKernelMissing`
(a ``NotImplementedError`` naming the kernel) when CALLED. Looking a name up
must not fail, because SGLang does ``from sgl_kernel import <name>`` at module
load on CPU (e.g. ``copy_all_layer_kv_cache_cpu`` in
``sglang/kernels/ops/kvcache/cache_move.py``) without ever calling it on the
native path. Submodules (``sgl_kernel.flash_attn`` ...) do not exist: importing
one raises ``ModuleNotFoundError``.

This module registers no ``torch.ops.sgl_kernel`` operators (Python cannot
provide them): ``hasattr(torch.ops.sgl_kernel, ...)`` probes stay False.

Debug aid: with ``CROSSPOOL_SGL_KERNEL_STANDIN_TRACE=/path/file`` every looked-up
name and every attempted submodule import is appended to that file, one
``<pid> attr|call|submodule <name>`` line each.
"""

import os as _os
import sys as _sys

__version__ = "0.0.0+crosspool.standin"
IS_CROSSPOOL_STANDIN = True

_TRACE = _os.environ.get("CROSSPOOL_SGL_KERNEL_STANDIN_TRACE")


def _trace(kind, name):
    if _TRACE:
        try:
            with open(_TRACE, "a") as f:
                f.write(f"{_os.getpid()} {kind} {name}\n")
        except OSError:
            pass


class SglKernelMissing(NotImplementedError):
    """A kernel of sgl_kernel was called, but this install only has the stand-in."""


def _message(name):
    return (
        f"sgl_kernel.{name} is needed but this install has no CPU sgl_kernel "
        "(the 'sgl_kernel' module is CrossPool's stand-in, distribution "
        "crosspool-sgl-kernel-standin, which contains no kernels); "
        "use a configuration that takes SGLang's native torch path "
        "(device='cpu', attention_backend='torch_native', a dense bf16/fp32 model)"
    )


def _make_stub(name):
    def stub(*args, **kwargs):
        _trace("call", name)
        raise SglKernelMissing(_message(name))

    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = __name__
    stub.__doc__ = f"Stand-in for sgl_kernel.{name}: raises NotImplementedError."
    stub.__crosspool_standin__ = True
    return stub


def __getattr__(name):
    # Dunder probes (copy, pickle, inspect, typing) behave as plain misses.
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    _trace("attr", name)
    stub = _make_stub(name)
    globals()[name] = stub  # later look-ups of the same name return the same stub
    return stub


def __dir__():
    return ["IS_CROSSPOOL_STANDIN", "SglKernelMissing", "__version__"]


if _TRACE:

    class _SubmoduleTracer:
        """Records attempted ``sgl_kernel.<sub>`` imports; finds nothing."""

        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname.startswith(__name__ + "."):
                _trace("submodule", fullname)
            return None

    _sys.meta_path.insert(0, _SubmoduleTracer())
