"""vLLM-Omni's own transformer classes built on the meta device, and where their loader puts each tensor.

Which Linears a checkpoint feeds, and under which runtime names, is the model class's business: it
decides which modules are vLLM Linears (quantizable) and which plain ``nn.Linear`` (BF16 always),
which projections it fuses, and how its ``load_weights`` renames checkpoint tensors. Rather than a
table per model, the class itself is asked:

1. :func:`find_transformer_class`: the class named by a component's ``config.json`` ``_class_name``,
   in vLLM-Omni's model packages (the pipeline's folder first, from vLLM-Omni's pipeline registry);
2. :func:`build_on_meta`: built from the component's config on the meta device (no memory) with the
   vLLM quantization config the caller passes, in a world-size-1 vLLM-Omni setup
   (:func:`world_of_one`, which reuses a process group that exists), so each Linear gets the method
   it would get in the engine; :class:`ProbeOverride` records which Linears the class hands a
   quantization config at all, and under which prefix;
3. :func:`trace_loading`: every checkpoint tensor is handed, as an empty meta tensor of its dtype
   and shape, to the model's own ``load_weights`` with every parameter's loader replaced by a
   recorder: where the loader puts it (parameter and fused piece) is the runtime name mapping,
   exactly as the engine applies it.

Imports torch, vLLM and vLLM-Omni (lazily, inside the functions, for the last two).
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import LayerRoute, Precision, QuantConfig
from ..formats.dtypes import TORCH_DTYPES
from .records import Placement, RuntimeLinear


class ModelError(ValueError):
    """The component's model class cannot be found or built; names the class and what to do."""


def find_transformer_class(class_name: str, pipeline: str | None = None) -> type:
    """The vLLM-Omni class named ``class_name``: searched in the pipeline's model folder first
    (vLLM-Omni's pipeline registry), then in every model folder. Only files whose text defines the
    class are imported."""
    import vllm_omni.diffusion.models as models

    root = Path(models.__file__).parent
    registry = getattr(importlib.import_module("vllm_omni.diffusion.registry"), "_DIFFUSION_MODELS", {})
    first = registry.get(pipeline, (None,))[0] if pipeline else None
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    folders.sort(key=lambda p: p.name != first)
    needle = f"class {class_name}("
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            if needle in path.read_text(encoding="utf-8", errors="replace"):
                module = importlib.import_module(f"{models.__name__}.{folder.name}.{path.stem}")
                return getattr(module, class_name)
    raise ModelError(
        f"no vLLM-Omni diffusion model class named {class_name!r} (config.json _class_name); vLLM-Omni "
        "cannot serve this component, or the checkpoint's config names another class"
    )


@contextlib.contextmanager
def world_of_one() -> Iterator[Any]:
    """vLLM-Omni's diffusion config, vLLM's current config and a TP=1 gloo group in this process, as
    vLLM's Linear layers need them; a group that is already initialized is reused, not torn down."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed import parallel_state as ps
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    od_config = OmniDiffusionConfig(model=None, dtype=torch.bfloat16, num_gpus=1)
    vllm_config = create_diffusion_vllm_config(torch.device("cpu"), od_config)
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config))
        stack.enter_context(set_current_vllm_config(vllm_config))
        if not torch.distributed.is_initialized():
            store = stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-omni-mxfp4-inspect-"))
            stack.callback(ps.destroy_distributed_environment)  # also after a partial setup
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{store}/pg",
                backend="gloo",
            )
            stack.callback(ps.destroy_model_parallel)
            ps.initialize_model_parallel(
                tensor_parallel_size=1, data_parallel_size=1, sequence_parallel_size=1, backend="gloo"
            )
        yield od_config


class ProbeOverride:
    """A route override (:mod:`vllm_omni_mxfp4.omni.routes`) that changes nothing and records the
    prefix of every Linear whose quantization method the class asks for: the Linears the class
    builds with its quantization config (the others run in BF16 whatever a checkpoint holds), and
    the names a config's layer lists must use for them."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []

    def override(self, prefix: str, route: LayerRoute, config: QuantConfig) -> tuple[LayerRoute, QuantConfig]:
        self.prefixes.append(prefix)
        return route, config


def build_on_meta(cls: type, config: Mapping[str, Any], quant_config: Any, od_config: Any) -> Any:
    """``cls`` built from a diffusers config on the meta device (bf16), as vLLM-Omni's pipelines
    build it: the config keys its ``__init__`` accepts, ``od_config`` where it takes one, and
    ``quant_config`` (a vLLM quantization config, or None) as its ``quant_config``."""
    import inspect as pyinspect

    from vllm_omni.diffusion.data import TransformerConfig
    from vllm_omni.diffusion.utils.tf_utils import get_transformer_config_kwargs

    params = {k: v for k, v in config.items() if k != "quantization_config"}
    kwargs = get_transformer_config_kwargs(TransformerConfig(params=params), cls)
    if quant_config is not None:
        kwargs["quant_config"] = quant_config
    if "od_config" in pyinspect.signature(cls.__init__).parameters:
        od_config.tf_model_config = TransformerConfig(params=params)
        kwargs["od_config"] = od_config
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return cls(**kwargs)
    except Exception as exc:
        raise ModelError(
            f"building {cls.__name__} from config.json failed ({type(exc).__name__}: {exc}); check that "
            "config.json belongs to this class and this vLLM-Omni version"
        ) from exc
    finally:
        torch.set_default_dtype(old)


def _vllm_linear(name: str, module: Any) -> RuntimeLinear:
    """How a vLLM Linear runs: our method's route, or BF16 (ours, or built without a quant config)."""
    method = module.quant_method
    sizes = tuple(getattr(module, "output_sizes", None) or (module.output_size,))
    bias = getattr(module, "bias", None) is not None
    common = dict(name=name, kind="vllm", in_features=module.input_size, out_sizes=sizes, has_bias=bias)
    fmt = getattr(method, "method_name", None)
    if fmt:  # vllm_omni_mxfp4.omni.linear.MxLinearMethod
        route = method.route
        return RuntimeLinear(
            **common,
            method=fmt,
            precision=route.precision.value,
            reason=route.reason,
            a8_steps=route.a8_steps,
        )
    route = getattr(method, "route", None)  # CheckedUnquantizedLinearMethod: our config chose BF16
    reason = route.reason if route is not None else "the model builds it without a quantization config"
    return RuntimeLinear(**common, method="bf16", precision=Precision.BF16.value, reason=reason)


def runtime_linears(model: Any) -> list[RuntimeLinear]:
    """Every vLLM Linear and plain ``nn.Linear`` of ``model``, in module order."""
    from vllm.model_executor.layers.linear import LinearBase

    found = []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            found.append(_vllm_linear(name, module))
        elif isinstance(module, torch.nn.Linear):
            found.append(
                RuntimeLinear(
                    name, "plain", "bf16", Precision.BF16.value, "plain nn.Linear (the model runs it in BF16)",
                    module.in_features, (module.out_features,), module.bias is not None,
                )
            )  # fmt: skip
    return found


def non_linear_modules(model: Any) -> dict[str, str]:
    """The modules of ``model`` that are no Linear and hold none (norms, embeddings, convolutions,
    activations), by name, with their class names: what a checkpoint's own ``ignored_layers`` may
    name besides Linears (vLLM-Omni's merge script lists every weight without a ``weight_scale``).
    A module that holds a Linear (a block, an attention) is not one of them: listing it would claim
    BF16 for Linears it does not name."""
    from vllm.model_executor.layers.linear import LinearBase

    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, (LinearBase, torch.nn.Linear))]
    holders = {".".join(n.split(".")[:i]) for n in linears for i in range(n.count(".") + 1)}
    return {
        name: type(module).__name__
        for name, module in modules.items()
        if name and name not in holders and not isinstance(module, (LinearBase, torch.nn.Linear))
    }


def block_lists(model: Any) -> dict[str, int]:
    """The model's top-level lists of blocks (``blocks``, ``transformer_blocks``...: ``ModuleList``
    children whose every item holds parameters, or is another pipeline-parallel rank's slot) and
    their lengths: the block counts its ``config.json`` asked for."""
    found = {}
    for name, child in model.named_children():
        if not isinstance(child, torch.nn.ModuleList) or not len(child):
            continue
        if all(
            type(item).__name__ == "PPMissingLayer" or next(item.parameters(), None) is not None
            for item in child
        ):
            found[name] = len(child)
    return found


def trace_loading(model: Any, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, Placement]:
    """Where the model's own ``load_weights`` puts each checkpoint tensor (name -> (dtype, shape)).

    Each tensor goes in alone, as an empty meta tensor, with every parameter's weight loader
    replaced by a recorder: nothing is copied, and an exception the model's loader raises for one
    tensor is that tensor's :attr:`Placement.error`. A tensor the loader skips has no placement.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    current: list[str] = [""]
    placed: dict[str, Placement] = {}

    def record(param: Any, loaded: Any, *shard: Any, **_: Any) -> None:
        placed[current[0]] = Placement(names.get(id(param)), shard[0] if shard else None)

    for param in model.parameters():
        with contextlib.suppress(AttributeError):
            param.weight_loader = record
        if getattr(param, "weight_loader", None) is not record:
            param._weight_loader = record  # vLLM's parameter classes expose it read-only
    for name, (dtype, shape) in tensors.items():
        current[0] = name
        torch_dtype = TORCH_DTYPES.get(dtype, torch.uint8)
        try:
            model.load_weights([(name, torch.empty(shape, dtype=torch_dtype, device="meta"))])
        except Exception as exc:  # the engine's loader would stop on it: reported with the tensor
            placed[name] = Placement(error=f"{type(exc).__name__}: {exc}")
    return placed
