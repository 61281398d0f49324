"""Start-up hook that lets a CUDA build of torchvision import beside CPU-only torch.

The only torchvision wheels the package registries offer for torch 2.13 are CUDA builds. Their C
extension cannot load next to CPU torch, so ``torchvision::nms`` and friends never get registered,
and ``import torchvision`` dies in ``torchvision/_meta_registrations.py`` when it registers fake
(meta) kernels for those missing operators. vLLM (through transformers), vLLM-Omni's ``Omni`` and
its Wan2.2 pipelines all import torchvision, so without this hook none of them import on CPU.

``scripts/env.sh`` installs this file into the environment's site-packages together with a ``.pth``
line that imports it at interpreter start-up, in every process (spawned workers included). It does
not import torch itself: it only adds a meta-path finder that waits for the first
``import torchvision`` and, just before it runs, makes ``torch.library.register_fake`` a no-op for
``torchvision::`` operators. torchvision's pure-Python parts (transforms, io helpers) then work; its
C ops (nms, roi_align, ...) stay unavailable, which the Wan2.2 text-to-video path never calls.

This is test-environment plumbing for CPU machines, not product code: on a machine with a matching
torchvision build, leave it out.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys

_PATCHED = False


def _patch_register_fake() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import torch.library as torch_library

    original = torch_library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            if args:  # direct form: register_fake("torchvision::op", fn)
                return args[0]
            return lambda fn: fn  # decorator form
        return original(op, *args, **kwargs)

    torch_library.register_fake = register_fake
    _PATCHED = True


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    """Patches torch just before the first ``import torchvision``; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            _patch_register_fake()
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
        return None


def install() -> None:
    """Register the finder once per interpreter."""
    if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())


install()
