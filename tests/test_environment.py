"""The test environment itself: the pinned engines import, in this process and in spawned ones."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest

pytestmark = pytest.mark.omni


def _imports_in_child(queue) -> None:
    try:
        import torchvision.transforms.functional  # noqa: F401
        import vllm
        import vllm_omni
        import vllm_omni.diffusion.models.wan2_2  # noqa: F401
        from vllm.model_executor.layers.linear import LinearBase  # noqa: F401
        from vllm_omni import Omni  # noqa: F401

        queue.put(("ok", vllm.__version__, vllm_omni.__version__))
    except BaseException as exc:  # report any failure to the parent
        queue.put(("error", repr(exc), ""))


def test_engines_import_in_a_spawned_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_imports_in_child, args=(queue,))
    proc.start()
    try:
        status, a, b = queue.get(timeout=240)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", a
    assert a.startswith("0.30") and b.startswith("0.30")


def test_cuda_builds_that_break_vllm_are_absent():
    for name in ("torchcodec", "torch_npu"):
        assert importlib.util.find_spec(name) is None, f"{name} must not be installed in the CPU test env"


def test_torchaudio_is_pure_python():
    """vLLM-Omni's API server imports torchaudio; its CUDA native libraries must be gone."""
    from pathlib import Path

    spec = importlib.util.find_spec("torchaudio")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    assert not list(root.rglob("*.so"))
    import torchaudio.functional  # noqa: F401


def test_torch_is_the_pinned_cpu_build():
    import torch

    assert torch.__version__.startswith("2.13.0")
    assert torch.version.cuda is None, "the test environment uses the CPU build of torch"
