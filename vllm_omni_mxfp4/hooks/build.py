"""Where vLLM-Omni builds a diffusion model: one wrapper per build function, its steps in one order.

- ``initialize_model`` (vLLM-Omni's registry, and the loader's copy of it), for every pipeline:

  1. a pipeline that is not Wan2.2 whose ``transformer`` directory holds an NVFP4 checkpoint is
     built under that expert's plan (:func:`~.nvfp4_loading.plan_nvfp4_expert` with the class's own
     names, :func:`~.nvfp4_loading.serving`);
  2. the pipeline is built;
  3. every component built with one of our configs has its checkpoint directory checked against
     the model and the config (:mod:`.checkpoint_dir`) and its layer names against the Linears it
     holds (:func:`~.names.check_pipeline`): a typo in ``ignored_layers`` stops the engine here,
     for every family, before any weight is read;
  4. deployment features that cannot run with our methods (HSDP, a LoRA merged into the weights,
     a cache backend the family cannot run) are refused (:func:`~.deployment.check_deployment`);
  5. the plan is attached to the transformer for the load (:func:`~.nvfp4_loading.attach`).

- ``_create_transformer`` of the Wan2.2 T2V, I2V and VACE pipelines (one call per expert):

  1. per-component keys naming an expert the pipeline lacks are refused
     (:func:`~.names.check_pipeline_experts`);
  2. an NVFP4 expert is built under its plan (Wan2.2's fixed names), its producer's
     ``quantization_config`` set aside, and the plan attached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..patching import MARKER, wrap_once
from .deployment import check_deployment
from .names import check_pipeline, check_pipeline_experts
from .nvfp4_loading import attach, plan_nvfp4_expert, serving

HOOK = "build"


def _builds_wan_experts(od_config: Any) -> bool:
    """Whether the pipeline builds its experts through a ``_create_transformer`` this hook wraps."""
    from vllm_omni.diffusion.registry import DiffusionModelRegistry

    cls = DiffusionModelRegistry._try_load_model_cls(getattr(od_config, "model_class_name", None))
    return getattr(getattr(cls, "_create_transformer", None), MARKER, None) == HOOK


def _initializing(original: Callable) -> Callable:
    """``initialize_model`` with the steps of the module docstring."""

    def run(od_config: Any, *args: Any, **kwargs: Any) -> Any:
        plan = (
            None
            if _builds_wan_experts(od_config)
            else plan_nvfp4_expert(od_config, "transformer", derived=True)
        )
        if plan is None:
            model = original(od_config, *args, **kwargs)
        else:
            with serving(od_config, plan):
                model = original(od_config, *args, **kwargs)
        check_pipeline(model, getattr(od_config, "model", None))
        check_deployment(model, od_config)
        if plan is not None:
            attach(getattr(model, "transformer", None), plan)
        return model

    return run


def _creating(original: Callable) -> Callable:
    """A Wan2.2 pipeline's ``_create_transformer`` with the steps of the module docstring."""

    def run(self: Any, config: dict, component: str = "transformer") -> Any:
        check_pipeline_experts(self)
        plan = plan_nvfp4_expert(self.od_config, component)
        if plan is None:
            return original(self, config, component)
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        with serving(self.od_config, plan):
            model = original(self, config, component)
        attach(model, plan)
        return model

    return run


def install() -> None:
    """Wrap the Wan2.2 pipelines' ``_create_transformer`` and vLLM-Omni's ``initialize_model``; idempotent."""
    from vllm_omni.diffusion import registry
    from vllm_omni.diffusion.model_loader import diffusers_loader
    from vllm_omni.diffusion.models.wan2_2 import pipeline_wan2_2, pipeline_wan2_2_i2v, pipeline_wan2_2_vace

    for pipeline in (
        pipeline_wan2_2.Wan22Pipeline,
        pipeline_wan2_2_i2v.Wan22I2VPipeline,
        pipeline_wan2_2_vace.Wan22VACEPipeline,
    ):  # each defines its own _create_transformer
        wrap_once(pipeline, "_create_transformer", _creating, HOOK)
    for module in (registry, diffusers_loader):  # the loader imported the function by name
        wrap_once(module, "initialize_model", _initializing, HOOK)
