#!/usr/bin/env python3
"""Generate docs/models.md: which vLLM-Omni diffusion transformers take our quantization methods.

    python tools/model_table.py           # rewrite docs/models.md
    python tools/model_table.py --check   # exit 1 with a diff when docs/models.md is out of date

The list of models is generated from the INSTALLED vLLM-Omni by an ``ast`` scan of
``vllm_omni/diffusion/models/**.py`` (no import, so a model whose optional dependencies are missing
is still listed, and the scan takes well under a second):

- a *diffusion transformer* is a top-level class whose name ends in ``Transformer2DModel``,
  ``Transformer3DModel`` or ``DiTModel`` (the diffusers naming every vLLM-Omni denoiser follows; the
  text encoders and autoregressive backbones, ``*LanguageModel``/``*TextModel``, are not denoisers);
- it *takes a quantization config* when its ``__init__`` (or, when it defines none, the nearest base
  class's: in the same file, else the one class of that name in the package) has a ``quant_config``
  parameter;
- in its file, the scan counts the vLLM Linear constructors (``ColumnParallelLinear``,
  ``RowParallelLinear``, ``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ReplicatedLinear``)
  called with a ``quant_config=`` argument other than a literal ``None``, those called without one,
  and the plain ``nn.Linear`` constructors (these always stay BF16).

The measured columns (Linears quantized at run time, cosine vs BF16 per method) come from
``MEASURED`` below, which ``tests/models`` checks against a tiny random build of each model: a test
fails when a measured count changes, and ``tests/models/test_model_table.py`` fails when vLLM-Omni
adds or drops a model and this page is not regenerated.
"""

from __future__ import annotations

import ast
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "models.md"
REGENERATE = "python tools/model_table.py"

TRANSFORMER_NAME = re.compile(r"(Transformer[23]DModel|DiTModel)$")
VLLM_LINEARS = frozenset(
    {
        "ColumnParallelLinear",
        "RowParallelLinear",
        "QKVParallelLinear",
        "MergedColumnParallelLinear",
        "ReplicatedLinear",
    }
)

# Measured by tests/models on a tiny random build (CPU, emulated kernels, one forward vs the BF16
# build with the same weights and inputs); tests/models fails when a measurement no longer matches.
# Runtime names, block indices folded to ``*``. ``quantized``: Linears running our methods (both
# methods quantize the same ones); ``plain``: ``nn.Linear`` (BF16); ``unquantized``: vLLM Linears the
# model builds without a quantization config (BF16); ``fused``: fused Linears (one runtime weight from
# several checkpoint tensors); ``packed``: the model's ``packed_modules_mapping`` (runtime ->
# checkpoint names); ``cosine``: of the output vs BF16, per method; ``contribution``: cosine of what
# the quantized Linears contribute (output minus the BF16 output with their weights zeroed), the
# measure that a broken quantization cannot hide behind a dominant residual path.
MEASURED: dict[str, dict] = {
    "wan2_2.WanTransformer3DModel": {
        "quantized": 16,
        "plain": [
            "condition_embedder.text_embedder.linear_1",
            "condition_embedder.text_embedder.linear_2",
            "condition_embedder.time_embedder.linear_1",
            "condition_embedder.time_embedder.linear_2",
            "condition_embedder.time_proj",
            "proj_out",
        ],
        "unquantized": [],
        "fused": ["blocks.*.attn1.to_qkv"],
        "packed": {"to_qkv": ["to_q", "to_k", "to_v"]},
        "cosine": {"mxfp4": 0.9997, "mxfp4_dualscale": 0.99976},
        "contribution": {"mxfp4": 0.96911, "mxfp4_dualscale": 0.97481},
    },
    "qwen_image.QwenImageTransformer2DModel": {
        "quantized": 16,
        "plain": [],
        "unquantized": [
            "img_in",
            "norm_out.linear",
            "proj_out",
            "time_text_embed.timestep_embedder.linear_1",
            "time_text_embed.timestep_embedder.linear_2",
            "transformer_blocks.*.img_mod.*",
            "transformer_blocks.*.txt_mod.*",
            "txt_in",
        ],
        "fused": ["transformer_blocks.*.attn.add_kv_proj", "transformer_blocks.*.attn.to_qkv"],
        "packed": {
            "to_qkv": ["to_q", "to_k", "to_v"],
            "add_kv_proj": ["add_q_proj", "add_k_proj", "add_v_proj"],
        },
        "cosine": {"mxfp4": 0.99859, "mxfp4_dualscale": 0.99856},
        "contribution": {"mxfp4": 0.9686, "mxfp4_dualscale": 0.96824},
    },
    "flux.FluxTransformer2DModel": {
        "quantized": 3,
        "plain": [
            "context_embedder",
            "proj_out",
            "time_text_embed.guidance_embedder.linear_1",
            "time_text_embed.guidance_embedder.linear_2",
            "time_text_embed.text_embedder.linear_1",
            "time_text_embed.text_embedder.linear_2",
            "time_text_embed.timestep_embedder.linear_1",
            "time_text_embed.timestep_embedder.linear_2",
            "x_embedder",
        ],
        "unquantized": [
            "norm_out.linear",
            "single_transformer_blocks.*.norm.linear",
            "transformer_blocks.*.attn.add_kv_proj",
            "transformer_blocks.*.attn.to_add_out",
            "transformer_blocks.*.attn.to_out.*",
            "transformer_blocks.*.attn.to_qkv",
            "transformer_blocks.*.ff.net.*",
            "transformer_blocks.*.ff.net.*.proj",
            "transformer_blocks.*.ff_context.net.*",
            "transformer_blocks.*.ff_context.net.*.proj",
            "transformer_blocks.*.norm1.linear",
            "transformer_blocks.*.norm1_context.linear",
        ],
        "fused": [
            "single_transformer_blocks.*.attn.to_qkv",
            "transformer_blocks.*.attn.add_kv_proj",
            "transformer_blocks.*.attn.to_qkv",
        ],
        "packed": {
            "to_qkv": ["to_q", "to_k", "to_v"],
            "add_kv_proj": ["add_q_proj", "add_k_proj", "add_v_proj"],
        },
        "cosine": {"mxfp4": 0.99795, "mxfp4_dualscale": 0.99778},
        "contribution": {"mxfp4": 0.96766, "mxfp4_dualscale": 0.96473},
    },
    "flux2.Flux2Transformer2DModel": {
        "quantized": 10,
        "plain": [
            "context_embedder",
            "double_stream_modulation_img.linear",
            "double_stream_modulation_txt.linear",
            "norm_out.linear",
            "proj_out",
            "single_stream_modulation.linear",
            "time_guidance_embed.guidance_embedder.linear_1",
            "time_guidance_embed.guidance_embedder.linear_2",
            "time_guidance_embed.timestep_embedder.linear_1",
            "time_guidance_embed.timestep_embedder.linear_2",
            "x_embedder",
        ],
        "unquantized": [],
        "fused": [
            "transformer_blocks.*.attn.add_kv_proj",
            "transformer_blocks.*.attn.to_qkv",
            "transformer_blocks.*.ff.linear_in",
            "transformer_blocks.*.ff_context.linear_in",
        ],
        "packed": {},
        "cosine": {"mxfp4": 0.99757, "mxfp4_dualscale": 0.99782},
        "contribution": {"mxfp4": 0.95547, "mxfp4_dualscale": 0.9595},
    },
    "flux2_klein.Flux2Transformer2DModel": {
        "quantized": 10,
        "plain": [
            "context_embedder",
            "double_stream_modulation_img.linear",
            "double_stream_modulation_txt.linear",
            "norm_out.linear",
            "proj_out",
            "single_stream_modulation.linear",
            "time_guidance_embed.timestep_embedder.linear_1",
            "time_guidance_embed.timestep_embedder.linear_2",
            "x_embedder",
        ],
        "unquantized": [],
        "fused": [
            "transformer_blocks.*.attn.add_kv_proj",
            "transformer_blocks.*.attn.to_qkv",
            "transformer_blocks.*.ff.linear_in",
            "transformer_blocks.*.ff_context.linear_in",
        ],
        "packed": {},
        "cosine": {"mxfp4": 0.999, "mxfp4_dualscale": 0.99903},
        "contribution": {"mxfp4": 0.95555, "mxfp4_dualscale": 0.95518},
    },
    "z_image.ZImageTransformer2DModel": {
        "quantized": 12,
        "plain": [],
        "unquantized": [
            "all_final_layer.2-1.adaLN_modulation.*",
            "all_final_layer.2-1.linear",
            "all_x_embedder.2-1",
            "cap_embedder.*",
            "layers.*.adaLN_modulation.*",
            "noise_refiner.*.adaLN_modulation.*",
            "t_embedder.mlp.*",
        ],
        "fused": [
            "context_refiner.*.attention.to_qkv",
            "context_refiner.*.feed_forward.w13",
            "layers.*.attention.to_qkv",
            "layers.*.feed_forward.w13",
            "noise_refiner.*.attention.to_qkv",
            "noise_refiner.*.feed_forward.w13",
        ],
        "packed": {"to_qkv": ["to_q", "to_k", "to_v"], "w13": ["w1", "w3"]},
        "cosine": {"mxfp4": 0.97938, "mxfp4_dualscale": 0.97424},
        "contribution": {"mxfp4": 0.94837, "mxfp4_dualscale": 0.93616},
    },
    "hunyuan_video.HunyuanVideo15Transformer3DModel": {
        "quantized": 8,
        "plain": [
            "context_embedder.proj_in",
            "context_embedder.time_text_embed.text_embedder.linear_1",
            "context_embedder.time_text_embed.text_embedder.linear_2",
            "context_embedder.time_text_embed.timestep_embedder.linear_1",
            "context_embedder.time_text_embed.timestep_embedder.linear_2",
            "context_embedder.token_refiner.refiner_blocks.*.attn.to_k",
            "context_embedder.token_refiner.refiner_blocks.*.attn.to_out.*",
            "context_embedder.token_refiner.refiner_blocks.*.attn.to_q",
            "context_embedder.token_refiner.refiner_blocks.*.attn.to_v",
            "context_embedder.token_refiner.refiner_blocks.*.ff.net.*",
            "context_embedder.token_refiner.refiner_blocks.*.ff.net.*.proj",
            "context_embedder.token_refiner.refiner_blocks.*.norm_out.linear",
            "context_embedder_2.linear_1",
            "context_embedder_2.linear_2",
            "context_embedder_2.linear_3",
            "image_embedder.linear_1",
            "image_embedder.linear_2",
            "norm_out.linear",
            "proj_out",
            "time_embed.timestep_embedder.linear_1",
            "time_embed.timestep_embedder.linear_2",
            "transformer_blocks.*.norm1.linear",
            "transformer_blocks.*.norm1_context.linear",
        ],
        "unquantized": [],
        "fused": ["transformer_blocks.*.attn.add_kv_proj", "transformer_blocks.*.attn.to_qkv"],
        "packed": {
            "to_qkv": ["to_q", "to_k", "to_v"],
            "add_kv_proj": ["add_q_proj", "add_k_proj", "add_v_proj"],
        },
        "cosine": {"mxfp4": 0.99998, "mxfp4_dualscale": 0.99998},
        "contribution": {"mxfp4": 0.95142, "mxfp4_dualscale": 0.94605},
    },
    "ltx2.LTX2VideoTransformer3DModel": {
        "quantized": 26,
        "plain": [
            "audio_caption_projection.linear_1",
            "audio_caption_projection.linear_2",
            "audio_proj_in",
            "audio_proj_out",
            "audio_time_embed.emb.timestep_embedder.linear_1",
            "audio_time_embed.emb.timestep_embedder.linear_2",
            "audio_time_embed.linear",
            "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_1",
            "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_2",
            "av_cross_attn_audio_scale_shift.linear",
            "av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_1",
            "av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_2",
            "av_cross_attn_audio_v2a_gate.linear",
            "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_1",
            "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_2",
            "av_cross_attn_video_a2v_gate.linear",
            "av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_1",
            "av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_2",
            "av_cross_attn_video_scale_shift.linear",
            "caption_projection.linear_1",
            "caption_projection.linear_2",
            "proj_in",
            "proj_out",
            "time_embed.emb.timestep_embedder.linear_1",
            "time_embed.emb.timestep_embedder.linear_2",
            "time_embed.linear",
        ],
        "unquantized": [],
        "fused": ["transformer_blocks.*.attn1.to_qkv"],
        "packed": {"to_qkv": ["to_q", "to_k", "to_v"]},
        "cosine": {"mxfp4": 0.99551, "mxfp4_dualscale": 0.99594},
        "contribution": {"mxfp4": 0.96489, "mxfp4_dualscale": 0.96826},
    },
    "ernie_image.ErnieImageTransformer2DModel": {
        "quantized": 14,
        "plain": [
            "adaLN_modulation.*",
            "final_linear",
            "final_norm.linear",
            "text_proj",
            "time_embedding.linear_1",
            "time_embedding.linear_2",
        ],
        "unquantized": [],
        "fused": [],
        "packed": {},
        "cosine": {"mxfp4": 0.99999, "mxfp4_dualscale": 0.99999},
        "contribution": {"mxfp4": 0.90155, "mxfp4_dualscale": 0.8819},
    },
    "helios.HeliosTransformer3DModel": {
        "quantized": 16,
        "plain": [
            "condition_embedder.text_embedder.linear_1",
            "condition_embedder.text_embedder.linear_2",
            "condition_embedder.time_embedder.linear_1",
            "condition_embedder.time_embedder.linear_2",
            "condition_embedder.time_proj",
            "proj_out",
        ],
        "unquantized": [],
        "fused": ["blocks.*.attn1.to_qkv"],
        "packed": {"to_qkv": ["to_q", "to_k", "to_v"]},
        "cosine": {"mxfp4": 0.99977, "mxfp4_dualscale": 0.99979},
        "contribution": {"mxfp4": 0.96993, "mxfp4_dualscale": 0.97149},
    },
}


# What the measurement does not show by itself (per class; also for classes not measured).
NOTES: dict[str, str] = {
    "flux.FluxTransformer2DModel": "vLLM-Omni builds the double-stream blocks with "
    "`safe_quant_config(quant_config)`, which is None for online methods: only the single-stream "
    "blocks' Linears quantize (3 per block)",
    "flux2.Flux2Transformer2DModel": "no `packed_modules_mapping`: `load_weights` maps `to_q/to_k/to_v` "
    "-> `to_qkv` and `add_q_proj/add_k_proj/add_v_proj` -> `add_kv_proj`; `ff.linear_in` is one "
    "checkpoint tensor",
    "flux2_klein.Flux2Transformer2DModel": "as FLUX.2: the fused names come from `load_weights`, not "
    "from a `packed_modules_mapping`",
    "z_image.ZImageTransformer2DModel": "FFN hidden size is int(dim / 3 * 8), quantizable only when "
    "even (the tiny model uses dim 768; the real dim 3840 gives 10240); the lowest tiny-model cosine "
    "of this table",
    "ernie_image.ErnieImageTransformer2DModel": "the quantized Linears' contribution to the tiny "
    "model's output is small (output cosine 0.99999), so BF16 rounding of the output bounds its "
    "contribution cosine near 0.88-0.90",
    "hidream_image.HiDreamImageTransformer2DModel": "takes `quant_config` but passes it to none of "
    "its blocks: nothing would be quantized",
    "wan2_2.WanVACETransformer3DModel": "a subclass of `WanTransformer3DModel` (its blocks)",
}


@dataclass(frozen=True)
class Transformer:
    """One diffusion transformer class found in the installed vLLM-Omni."""

    package: str
    path: str
    name: str
    takes_quant_config: bool
    vllm_linears_with_config: int
    vllm_linears_without_config: int
    plain_linears: int

    @property
    def key(self) -> str:
        return f"{self.package}.{self.name}"


def models_root() -> Path:
    """``vllm_omni/diffusion/models`` of the installed package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm_omni is not installed: the model table is generated from it")
    return Path(next(iter(spec.submodule_search_locations))) / "diffusion" / "models"


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _linear_counts(tree: ast.Module) -> tuple[int, int, int]:
    """(vLLM Linears given a quant_config, vLLM Linears without one, plain nn.Linear) in a file."""
    given = without = plain = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if name in VLLM_LINEARS:
            kw = {k.arg: k.value for k in node.keywords}
            value = kw.get("quant_config")
            if value is None or (isinstance(value, ast.Constant) and value.value is None):
                without += 1
            else:
                given += 1
        elif name == "Linear" and isinstance(node.func, ast.Attribute):
            plain += 1
    return given, without, plain


def _init_args(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], index: dict[str, list]) -> list[str]:
    """The ``__init__`` parameters of ``cls`` or of its nearest base that defines one: a base in the
    same file first, else a class of that name defined once elsewhere in the models package."""
    seen = set()
    while cls is not None and cls.name not in seen:
        seen.add(cls.name)
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                return [a.arg for a in node.args.args + node.args.kwonlyargs]
        bases = [ast.unparse(b).split(".")[-1] for b in cls.bases]
        local = [classes[b] for b in bases if b in classes]
        elsewhere = [index[b][0] for b in bases if len(index.get(b, ())) == 1]
        cls = (local + elsewhere + [None])[0]
    return []


def scan(root: Path | None = None) -> list[Transformer]:
    """Every diffusion transformer class of the installed vLLM-Omni, sorted by package and name."""
    root = root or models_root()
    trees = {
        path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for path in sorted(root.rglob("*.py"))
    }
    index: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                index.setdefault(node.name, []).append(node)
    found = []
    for path, tree in trees.items():
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        names = [name for name in classes if TRANSFORMER_NAME.search(name)]
        if not names:
            continue
        counts = _linear_counts(tree)
        rel = path.relative_to(root)
        for name in names:
            takes = "quant_config" in _init_args(classes[name], classes, index)
            found.append(Transformer(rel.parts[0], rel.as_posix(), name, takes, *counts))
    return sorted(found, key=lambda t: (t.package, t.name))


def _names(names: list[str]) -> str:
    return "<br>".join(f"`{n}`" for n in names) or "none"


def _measured_cells(t: Transformer) -> list[str]:
    m = MEASURED.get(t.key)
    note = NOTES.get(t.key, "")
    if m is None:
        return ["not measured", "", "", "", "", note]
    packed = "; ".join(f"`{k}` <- {', '.join(f'`{c}`' for c in v)}" for k, v in m["packed"].items())
    fused = _names(m["fused"]) + (f"<br>({packed})" if packed else "")
    cosine = "<br>".join(
        f"{method} {value:.5f} ({m['contribution'][method]:.3f})" for method, value in m["cosine"].items()
    )
    return [str(m["quantized"]), _names(m["plain"]), _names(m["unquantized"]), fused, cosine, note]


def render(transformers: list[Transformer] | None = None) -> str:
    """The whole docs/models.md text."""
    transformers = scan() if transformers is None else transformers
    lines = [
        "# Diffusion transformers of vLLM-Omni and the MXFP4 methods",
        "",
        f"<!-- generated by {REGENERATE}; do not edit by hand -->",
        "",
        "Generated from the installed vLLM-Omni by an `ast` scan of `vllm_omni/diffusion/models` (how: the",
        "docstring of `tools/model_table.py`). A class *takes a quantization config* when its `__init__`",
        "has a `quant_config` parameter; the Linear columns count constructor calls in the model's file:",
        "vLLM Linears given a `quant_config` (these run `mxfp4` / `mxfp4_dualscale` when the model passes",
        "its config on), vLLM Linears built without one, and plain `nn.Linear` (always BF16).",
        "",
        "The measured columns come from `tests/models`: the transformer built from a tiny random config",
        "of its own class on the CPU platform, quantized online with both methods (emulated kernels,",
        "`num_bf16_fallback_layers` 0), one forward against the BF16 build with the same weights and",
        "inputs. Cosine there is of tiny random models, not of real checkpoints (Wan2.2's real",
        "transformer measured 0.9997 W4A4). In brackets: the cosine of what the quantized Linears",
        "contribute (the output minus the BF16 output with their weights zeroed); tiny random models",
        "pass most of their output through the residual path, so the output cosine alone would hide a",
        "broken quantization (a Q/K/V shard-order error leaves HunyuanVideo-1.5's output at 0.9997 and",
        "its contribution at 0.0).",
        "",
        "## Classes",
        "",
        "| package | transformer class | takes `quant_config` | vLLM Linears with config / without"
        " / `nn.Linear` (file) |",
        "|---|---|---|---|",
    ]
    for t in transformers:
        counts = f"{t.vllm_linears_with_config} / {t.vllm_linears_without_config} / {t.plain_linears}"
        yes = "yes" if t.takes_quant_config else "no"
        lines.append(f"| `{t.package}` | `{t.name}` (`{t.path}`) | {yes} | {counts} |")
    lines += [
        "",
        "## Measured online",
        "",
        "| transformer | Linears quantized | BF16: `nn.Linear` | BF16: vLLM Linear without config |"
        " fused (runtime; `packed_modules_mapping`) | cosine vs BF16 (of the quantized Linears' contribution) |"
        " notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in transformers:
        if t.takes_quant_config:
            lines.append("| " + " | ".join([f"`{t.key}`", *_measured_cells(t)]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
    if "--check" in argv:
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True)))
        return 1
    tmp = OUTPUT.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(OUTPUT)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
