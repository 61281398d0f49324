"""Lazy torch access to a component's safetensors files: one tensor at a time, memory-mapped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch

from vllm_omni_mxfp4.errors import CheckpointError
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight
from vllm_omni_mxfp4.safetensors_io import TensorRef
from vllm_omni_mxfp4.sources.nvfp4 import LayerSource, SourceError, load_nvfp4_weight


class TensorReader:
    """Tensors of an archive (name -> :class:`TensorRef`) by name, read as torch tensors on demand.

    Files are opened on first use and closed by :meth:`close`; nothing is read before it is asked
    for, so planning costs headers only.
    """

    def __init__(self, archive: Mapping[str, TensorRef]) -> None:
        self._archive = archive
        self._stack = ExitStack()
        self._files: dict[Path, object] = {}
        self._modules: dict[str, list[str]] = defaultdict(list)
        for key in archive:
            self._modules[key.rpartition(".")[0]].append(key)

    def ref(self, key: str) -> TensorRef:
        """Where tensor ``key`` is stored (its header entry)."""
        return self._archive[key]

    def module_keys(self, module: str) -> list[str]:
        """Every stored tensor key directly under ``module`` (sorted)."""
        return sorted(self._modules.get(module, []))

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as stored (dtype and shape of its header entry)."""
        from safetensors import safe_open

        path = self._archive[key].path
        if path not in self._files:
            self._files[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._files[path].get_tensor(key)

    def nvfp4_loader(self, layer: LayerSource) -> Callable[[], Nvfp4Weight]:
        """A function that loads ``layer``'s canonical NVFP4 weight (a refusal names the layer)."""

        def load() -> Nvfp4Weight:
            try:
                return load_nvfp4_weight(layer, self.tensor)
            except SourceError as exc:
                raise CheckpointError(f"{self._archive[layer.tensors['weight']].path}: {exc}") from None

        return load

    def close(self) -> None:
        """Close every opened file."""
        self._stack.close()
        self._files.clear()
