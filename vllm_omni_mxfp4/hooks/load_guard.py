"""The guard around vLLM-Omni's pipeline weight loading: failures named, unknown tensors refused.

:func:`install` routes ``DiffusersPipelineLoader.load_weights`` through :func:`guarded_load_weights`
for every diffusion model the process loads, quantized or not:

- a tensor vLLM's own weight loaders cannot place (a bare ``assert`` or ``narrow()`` overflow deep in
  vLLM) is reported as the checkpoint tensor, what the model's parameter is and what to do
  (:func:`misfit_message`): a quantized checkpoint read without its ``quantization_config`` is the
  usual cause;
- tensors under a quantized Linear's prefix that the model does not load are refused
  (:func:`refuse_unknown_tensors`), rather than skipped as vLLM does;
- the layers of an NVFP4 checkpoint's experts are requantized in the stream first
  (:func:`~.nvfp4_loading.convert_stream`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..models.wan import runtime_layer_name
from ..patching import wrap_once
from ..spec import FORMAT_TENSORS, LOW_RANK_L1, LOW_RANK_L2
from .nvfp4_loading import convert_stream


class _Stream:
    """The checkpoint's ``(name, tensor)`` stream as the model consumes it: every name, and the pair
    being loaded now (``None`` while the reader itself runs, so its errors are not blamed on a tensor)."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it = iter(weights)
        self.names: list[str] = []
        self.current: tuple[str, torch.Tensor] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        self.current = None
        name, tensor = next(self._it)
        self.names.append(name)
        self.current = (name, tensor)
        return name, tensor


def _layer_of(model: torch.nn.Module, name: str) -> tuple[str, torch.nn.Module | None]:
    """The runtime path and module of the Linear a checkpoint tensor ``name`` belongs to."""
    layer = name.rsplit(".", 1)[0]
    with contextlib.suppress(ValueError):  # not a Wan2.2 Linear name: keep the checkpoint's path
        layer = runtime_layer_name(layer)
    try:
        return layer, model.get_submodule(layer)
    except AttributeError:
        return layer, None


def misfit_message(model: torch.nn.Module, name: str, tensor: torch.Tensor, exc: BaseException) -> str:
    """One message for a checkpoint tensor that vLLM's own weight loader could not place."""
    layer, module = _layer_of(model, name)
    leaf = name.rsplit(".", 1)[-1]
    method = getattr(module, "quant_method", None)
    param = getattr(module, leaf, None) if module is not None else None
    wants = f"{param.dtype} {tuple(param.shape)}" if isinstance(param, torch.Tensor) else "no such parameter"
    head = (
        f"{name}: the checkpoint holds {tensor.dtype} {tuple(tensor.shape)}, but the model's {layer}.{leaf} "
        f"({type(method).__name__ if method is not None else 'no quant method'}) is {wants}"
    )
    if not tensor.is_floating_point():
        return (
            f"{head}: the file holds a quantized layer's packed FP4 bytes while the model built the layer "
            "in BF16, because the transformer's config.json has no usable quantization_config (missing, {}, "
            "[] or not an object) and no quantization argument was given. Restore quantization_config "
            "(quant_method, is_checkpoint_mxfp4_serialized / is_checkpoint_serialized: true, "
            "ignored_layers; vllm-omni-mxfp4 merge writes it). vLLM's loader said: "
            f"{type(exc).__name__}: {exc}"
        )
    return (
        f"{head}: the tensor's shape does not match the model that config.json describes (a {leaf} of the "
        "wrong length, or a config.json of another model). Fix or re-export the tensor, or use the "
        f"config.json it was exported with. vLLM's loader said: {type(exc).__name__}: {exc}"
    )


def refuse_unknown_tensors(names: list[str], loaded: set[str]) -> None:
    """Tensors in a quantized layer's prefix that the model did not load are an error, not skipped;
    so is a low-rank pair the model did not load, on any layer (its Linear would run without it)."""
    pairs = [n for n in names if n not in loaded and n.rsplit(".", 1)[-1] in (LOW_RANK_L1, LOW_RANK_L2)]
    if pairs:
        layers = sorted({n.rsplit(".", 1)[0] for n in pairs})
        raise ValueError(
            f"{pairs[0]}: the checkpoint stores a low-rank pair ({LOW_RANK_L1}/{LOW_RANK_L2}) for "
            f"{len(layers)} Linear(s) {layers[:6]} that the quantization_config does not list in "
            "svd_lowrank_layers, so the model has no branch to load it into and the layer would run without "
            "it: a BF16 (ignored_layers) or unlisted layer. List each quantized layer with its rank in "
            "svd_lowrank_layers, or export again (vllm-omni-mxfp4 merge writes the list from the export)."
        )
    quantized = {n.rsplit(".", 1)[0] for n in loaded if n.endswith(".weight_scale")}
    unknown = [n for n in names if n not in loaded and n.rsplit(".", 1)[0] in quantized]
    if unknown:
        known = sorted({t.name for tensors in FORMAT_TENSORS.values() for t in tensors})
        raise ValueError(
            f"{len(unknown)} checkpoint tensors in the prefix of quantized Linears are unknown to the model "
            f"and would be ignored: {unknown[:8]}. A quantized Linear loads only {known}. The checkpoint was "
            "written for another format or tool (e.g. static activation scales), or a name is misspelt; "
            "remove these tensors or export the checkpoint again (vllm-omni-mxfp4 merge)."
        )


def _raised_in_vllm(exc: BaseException) -> bool:
    """Whether the innermost Python frame of ``exc`` is vLLM's own code (its weight loaders), so that
    errors of this package's kernels or of torch elsewhere keep their own message."""
    import vllm

    root = os.path.dirname(vllm.__file__) + os.sep
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(root)


def guarded_load_weights(model: torch.nn.Module, load_weights: Callable, weights: Iterable) -> Any:
    """``model.load_weights(weights)`` with every vLLM loader failure named, and unknown tensors of
    quantized layers refused (the model's loader skips names it has no parameter for). The layers of an
    NVFP4 checkpoint's experts are requantized in the stream first (:mod:`.nvfp4_loading`)."""
    stream = _Stream(convert_stream(model, weights))
    try:
        loaded = load_weights(stream)
    except (AssertionError, RuntimeError) as exc:  # a bare assert or narrow() overflow in vLLM's loaders
        if stream.current is None or not _raised_in_vllm(exc):
            raise
        raise ValueError(misfit_message(model, *stream.current, exc)) from exc
    if loaded is not None:
        refuse_unknown_tensors(stream.names, set(loaded))
    return loaded


def _guarding(original: Callable) -> Callable:
    """``DiffusersPipelineLoader.load_weights`` with the model's ``load_weights`` guarded for the call."""

    def load_weights(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        had = "load_weights" in vars(model)
        inner = model.load_weights
        model.load_weights = functools.partial(guarded_load_weights, model, inner)
        try:
            return original(self, model, *args, **kwargs)
        finally:
            if had:
                model.load_weights = inner
            else:
                del model.load_weights

    return load_weights


def install() -> None:
    """Route vLLM-Omni's ``DiffusersPipelineLoader.load_weights`` through :func:`guarded_load_weights`
    (idempotent). Every diffusion model load of the process is covered, quantized or not, so that a
    quantized checkpoint loaded without its quantization_config is named too."""
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    wrap_once(DiffusersPipelineLoader, "load_weights", _guarding, "load_guard")
