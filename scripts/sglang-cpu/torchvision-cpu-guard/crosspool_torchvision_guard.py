"""Make ``import torchvision`` work when its C++ extension cannot load.

torchvision from PyPI (x86_64) is built against CUDA torch; beside
torch 2.13.0+cpu its ``_C`` extension fails to load (libc10_cuda.so missing),
which torchvision tolerates (``torchvision.extension._has_ops()`` is False),
EXCEPT for two unguarded fake-kernel registrations in
``torchvision/_meta_registrations.py``::

    @torch.library.register_fake("torchvision::nms")
    @torch.library.register_fake("torchvision::qnms")

which raise ``RuntimeError: operator torchvision::nms does not exist`` and
abort ``import torchvision`` (SGLang imports torchvision at module load).

This module, imported at interpreter start by ``crosspool_torchvision_guard.pth``,
adds a meta-path finder that acts only when ``torchvision._meta_registrations``
is about to be imported: if torchvision's ops did not load, it defines the two
operator SCHEMAS (no kernels) so those registrations succeed. Nothing is
imported eagerly (no torch import at start-up), no file is modified, and the
ops stay unusable: ``torchvision.ops.nms`` still raises torchvision's own
"Couldn't load custom C++ ops" error. With a working torchvision (its ``_C``
loaded) this does nothing.
"""

import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIB = None  # keep the torch.library.Library alive (it unregisters on collection)


def _define_missing_schemas():
    global _LIB
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return
    for name, schema in _SCHEMAS.items():
        if hasattr(torch.ops.torchvision, name):
            continue
        if _LIB is None:
            _LIB = torch.library.Library("torchvision", "FRAGMENT")
        _LIB.define(schema)


class _TorchvisionGuardFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname == "torchvision._meta_registrations":
            _define_missing_schemas()
        return None  # the regular finders import the module


if not any(isinstance(f, _TorchvisionGuardFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionGuardFinder())
