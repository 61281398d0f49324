"""BF16 layers kept by default per model family: where a published MXFP4 recipe keeps them, and where
the model's own code cannot run a packed weight.

One table, :data:`FAMILY_DEFAULTS`: per vLLM-Omni transformer class, the runtime Linear names kept
unquantized, and why. A recipe's default applies to online quantization only (an offline
checkpoint's ``ignored_layers`` say what it stores), and only when the user's config lists no
``ignored_layers``: any list the user gives replaces it. A ``required`` one (the model casts a
Linear's input to that Linear's weight dtype, the packed uint8 of a quantized weight, on every
device) always applies, whatever else is listed, online and offline: an offline checkpoint that
stores such a Linear quantized is refused at load. Where the model builds a listed layer without a
quantization config (it is BF16 anyway) the entry changes nothing.

Only MXFP4 recipes are taken: msModelSlim's (Ascend's producer of MXFP4 checkpoints). Its
Wan2.2 recipe keeps blocks 0-4 in W8A8, not BF16 (Wan's leading-block rule,
``num_bf16_fallback_layers``, is upstream vLLM-Omni's own default and stays as it is). ModelOpt's
diffusers recipes (FLUX, LTX-2, Wan, Qwen-Image) are NVFP4/FP8 recipes and are not applied; the
user guide lists what they keep, for users who want to write them into ``ignored_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import MappingProxyType

from .methods import MethodConfig
from .routing import LayerRoute, Precision


@dataclass(frozen=True)
class FamilyDefault:
    """The BF16 default of one transformer class: ``bf16`` are ``fnmatch`` patterns over runtime
    Linear names (the recipe's own patterns where its names are the runtime ones), ``source`` the
    published recipe they come from, or the model code that needs them; ``required``: kept BF16
    whatever the user's config says (module docstring)."""

    model: str
    module: str
    bf16: tuple[str, ...]
    source: str
    required: bool = False

    @property
    def class_name(self) -> str:
        return self.model.split(".")[-1]

    def matches(self, prefix: str) -> bool:
        """Whether the Linear at runtime path ``prefix`` stays BF16 under this default."""
        return any(fnmatchcase(prefix, pattern) for pattern in self.bf16)

    def route(self, route: LayerRoute) -> LayerRoute:
        """``route`` turned BF16 when this default names its layer (a BF16 route stays as it is)."""
        if route.precision is Precision.BF16 or not self.matches(route.prefix):
            return route
        if self.required:
            reason = f"kept BF16 for {self.class_name}: {self.source}"
        else:
            reason = (
                f"kept BF16 by the {self.class_name} default ({self.source}); give ignored_layers to override"
            )
        return LayerRoute(Precision.BF16, (), reason, route.prefix)

    def applies_to(self, config: MethodConfig) -> bool:
        """Whether this default applies under ``config``: always when ``required``, else only online
        and without ``ignored_layers`` (module docstring)."""
        return self.required or not (config.is_serialized or config.ignored_layers)

    def override(
        self, prefix: str, route: LayerRoute, config: MethodConfig
    ) -> tuple[LayerRoute, MethodConfig]:
        """This default as a route override (``vllm_omni_mxfp4.omni.routes``): :meth:`route` where it
        applies under the config decided so far (an NVFP4 checkpoint's is offline)."""
        return (self.route(route) if self.applies_to(config) else route), config


QWEN_IMAGE = FamilyDefault(
    model="qwen_image.QwenImageTransformer2DModel",
    module="vllm_omni.diffusion.models.qwen_image.qwen_image_transformer",
    # vLLM-Omni builds img_mod.1 / txt_mod.1 without a quantization config: BF16 already
    bf16=("*txt_mlp.net.2*", "*img_mod.1*", "*txt_mod.1*"),
    source="msModelSlim 26.1 lab_practice/qwen_image_edit/qwen-image-edit-w4a4f4-mxfp.yaml, linear_quant exclude",
)

SANA_WM = FamilyDefault(
    model="sana_wm.SanaWmTransformer3DModel",
    module="vllm_omni.diffusion.models.sana_wm.sana_wm_transformer",
    bf16=("t_embedder.mlp.0", "blocks.*.attn.proj"),
    source="vLLM-Omni 0.30 casts their input to the Linear's weight dtype (SanaWmTimestepEmbedder.forward, "
    "SanaWmSelfAttention._apply_output_gate_and_proj), the packed uint8 of a quantized weight",
    required=True,
)

FAMILY_DEFAULTS = MappingProxyType({d.model: d for d in (QWEN_IMAGE, SANA_WM)})
"""Transformer class (``package.Class`` as in docs/models.md) -> its BF16 default."""
