"""Per-Linear statistics that decide how well MXFP4 works, for a diffusers Wan2.2 pipeline: what
trained weights change against random ones (docs/quality.md).

For every Linear of the transformers (the blocks', which vLLM-Omni quantizes, and the embedders' and
``proj_out``, which it keeps in BF16), :func:`linear_stats` measures

- the weight's and the captured input activation's kurtosis (Pearson, 3 for a Gaussian: heavy tails
  are what 4-bit elements with one shared scale per 32 values lose most on);
- their crest factor per 32-block along K (the block's max |x| over its RMS, averaged over blocks:
  how far the shared power-of-two scale has to stretch to cover the block's largest value);
- the activation's outlier-channel ratio (largest per-channel RMS over the median one);
- the quantization error: the relative error of the MXFP4 weight alone, and the SQNR of the W4A4
  output (weights and activations fake-quantized with the OCP rule, the emulated backend's
  arithmetic) against the FP32 output, on the captured activations.

Activations are captured while diffusers' ``WanPipeline`` generates task prompts (every denoising
step, both classifier-free-guidance branches), a subsample of rows per call.

    python -m vllm_omni_mxfp4_tiny.linear_stats [--model DIR] [--json OUT]

compares the shipped trained pipeline with the same pipeline whose experts are drawn from diffusers'
default initialization (what the random-weight tiny builders use).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .trained_wan import generate

logger = logging.getLogger(__name__)

BLOCK = 32
ROWS_PER_CALL = 64


@dataclass(frozen=True)
class LinearStats:
    """What :func:`linear_stats` measured for one Linear (``name`` as ``transformer.blocks.0.attn1.to_q``)."""

    name: str
    n: int
    k: int
    weight_kurtosis: float
    weight_block_crest: float
    act_kurtosis: float
    act_block_crest: float
    act_channel_ratio: float
    weight_rel_error: float
    output_sqnr_db: float


def _kurtosis(x: Any) -> float:
    x = x.double().flatten()
    centred = x - x.mean()
    var = centred.pow(2).mean()
    return float(centred.pow(4).mean() / var.pow(2)) if var > 0 else math.nan


def _block_crest(x: Any) -> float:
    """Mean over 32-blocks along the last dim of max |x| / RMS (blocks that are all zero skipped)."""
    k = x.shape[-1] - x.shape[-1] % BLOCK
    blocks = x[..., :k].double().reshape(-1, BLOCK)
    rms = blocks.pow(2).mean(dim=1).sqrt()
    keep = rms > 0
    return float((blocks.abs().amax(dim=1)[keep] / rms[keep]).mean())


def _channel_ratio(x: Any) -> float:
    rms = x.double().reshape(-1, x.shape[-1]).pow(2).mean(dim=0).sqrt()
    median = rms.median()
    return float(rms.max() / median) if median > 0 else math.inf


def _measure(name: str, weight: Any, acts: Any) -> LinearStats:
    import torch

    from vllm_omni_mxfp4.formats.mx import fake_quantize_mx

    w = weight.detach().float()
    wq = fake_quantize_mx(w, elem="fp4", scale_rule="floor")
    xq = fake_quantize_mx(acts, elem="fp4", scale_rule="floor")
    reference = acts @ w.T
    error = xq @ wq.T - reference
    sqnr = 10 * math.log10(float(reference.pow(2).sum()) / max(float(error.pow(2).sum()), 1e-30))
    return LinearStats(
        name=name,
        n=w.shape[0],
        k=w.shape[1],
        weight_kurtosis=_kurtosis(w),
        weight_block_crest=_block_crest(w),
        act_kurtosis=_kurtosis(acts),
        act_block_crest=_block_crest(acts),
        act_channel_ratio=_channel_ratio(acts),
        weight_rel_error=float(torch.linalg.norm(wq - w) / torch.linalg.norm(w)),
        output_sqnr_db=sqnr,
    )


def linear_stats(
    pipeline: Any, prompts: Sequence[str], *, seed: int, steps: int, guidance: float, guidance_2: float
) -> list[LinearStats]:
    """Statistics of every Linear of ``pipeline``'s transformers (a diffusers ``WanPipeline``
    computing in FP32), from activations captured while it generates ``prompts``."""
    import torch

    captured: dict[str, list[Any]] = {}
    linears: dict[str, Any] = {}
    handles = []
    rows_generator = torch.Generator().manual_seed(seed)
    for component in ("transformer", "transformer_2"):
        module = getattr(pipeline, component, None)
        if module is None:
            continue
        for name, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear):
                key = f"{component}.{name}"
                linears[key], captured[key] = layer, []

                def hook(layer: Any, inputs: tuple[Any, ...], key: str = key) -> None:
                    rows = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
                    pick = torch.randperm(rows.shape[0], generator=rows_generator)[:ROWS_PER_CALL]
                    captured[key].append(rows[pick])

                handles.append(layer.register_forward_pre_hook(hook))
    try:
        generate(pipeline, prompts, seed, steps, guidance, guidance_2)
    finally:
        for handle in handles:
            handle.remove()
    return [_measure(key, linears[key].weight, torch.cat(captured[key])) for key in linears if captured[key]]


def _kind(name: str) -> str:
    """``transformer.blocks.3.attn1.to_q`` -> ``attn1.to_q``; ``transformer_2.proj_out`` -> ``proj_out``."""
    parts = name.split(".")
    return ".".join(parts[3:] if parts[1] == "blocks" else parts[1:])


def summarize(stats: Sequence[LinearStats]) -> dict[str, dict[str, float]]:
    """Medians per Linear kind (``attn1.to_q``, ``ffn.net.2``, ``proj_out``, ...) over blocks and
    experts, plus ``blocks`` (every block Linear: what vLLM-Omni quantizes)."""
    groups: dict[str, list[LinearStats]] = {"blocks": [s for s in stats if s.name.split(".")[1] == "blocks"]}
    for s in stats:
        groups.setdefault(_kind(s.name), []).append(s)
    fields = [f for f in LinearStats.__dataclass_fields__ if f not in ("name", "n", "k")]
    return {
        kind: {f: statistics.median(getattr(s, f) for s in members) for f in fields}
        for kind, members in groups.items()
    }


def _random_experts(pipeline: Any) -> Any:
    """The same pipeline with both experts drawn from diffusers' default initialization (what the
    random-weight tiny builders use; training itself starts from adaLN-Zero, whose output is zero)."""
    import copy

    from diffusers import WanTransformer3DModel

    from .trained_wan import TRANSFORMER_CONFIG, WanRecipe, _seeded

    other = copy.copy(pipeline)
    seed = WanRecipe.transformer_seed
    experts = [_seeded(seed + i, lambda: WanTransformer3DModel(**TRANSFORMER_CONFIG)) for i in range(2)]
    other.register_modules(transformer=experts[0], transformer_2=experts[1])
    return other


def main(argv: list[str] | None = None) -> int:
    """The CLI: trained vs random-weight statistics, as a table (and JSON with ``--json``)."""
    import torch
    from diffusers import WanPipeline

    from .task import TRAINING_SEEDS, sample_prompts, video_prompts
    from .trained_wan import EVAL_GUIDANCE, EVAL_GUIDANCE_2, EVAL_STEPS, SHIPPED

    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_mxfp4_tiny.linear_stats", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=SHIPPED,
        help="A trained tiny Wan2.2 pipeline (default: the shipped one).",
    )
    parser.add_argument(
        "--prompts", type=int, default=4, help="Task prompts to capture activations on (default 4)."
    )
    parser.add_argument("--json", type=Path, default=None, help="Also write every Linear's numbers here.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pipeline = WanPipeline.from_pretrained(args.model).to(torch.float32)
    prompts = [p.text for p in sample_prompts(video_prompts(held_out=False), args.prompts, seed=7)]
    options = {
        "seed": TRAINING_SEEDS + 7,
        "steps": EVAL_STEPS,
        "guidance": EVAL_GUIDANCE,
        "guidance_2": EVAL_GUIDANCE_2,
    }
    results = {
        "trained": linear_stats(pipeline, prompts, **options),
        "random": linear_stats(_random_experts(pipeline), prompts, **options),
    }
    summaries = {label: summarize(stats) for label, stats in results.items()}
    fields = list(summaries["trained"]["blocks"])
    print(f"medians over blocks and experts of {len(results['trained'])} Linears; trained / random")
    print("kind".ljust(22) + "".join(f.rjust(22) for f in fields))
    for kind in summaries["trained"]:
        cells = [f"{summaries['trained'][kind][f]:.2f} / {summaries['random'][kind][f]:.2f}" for f in fields]
        print(kind.ljust(22) + "".join(c.rjust(22) for c in cells))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {label: [asdict(s) for s in stats] for label, stats in results.items()}
                | {"summary": summaries},
                indent=2,
            )
        )
        print(f"per-Linear numbers: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
