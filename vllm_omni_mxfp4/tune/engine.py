"""The tuning engine's worker side: every quantized Linear at a precision chosen per pass, and scores.

``vllm-omni-mxfp4 tune`` builds one ``Omni(...)`` engine with this module's worker extension
(:data:`TUNE_EXTENSION`) and ``VLLM_OMNI_MXFP4_KEEP_BF16`` set, so that online quantization keeps
each quantized Linear's BF16 weight on the host. :meth:`TuneExtension.mxfp4_tune_setup` then puts a
:class:`TunedLinearMethod` in front of each of the model's MXFP4 Linear methods. Between
generations, :meth:`~TuneExtension.mxfp4_tune_plan` says how every such Linear runs in the next ones:

- ``bf16``: vLLM's own unquantized Linear method on the kept weight (the arithmetic of a BF16
  layer in serving), built when first needed and dropped when a plan no longer needs it;
- ``w4a8`` / ``w4a4``: the layer's own MXFP4 kernel at that precision (the serving kernel);
- a scoring pass: every Linear returns its BF16 output, so the trajectory is the BF16 model's, and
  on each call also runs its kernel at W4A4 (and W4A8 where the method allows it) on the same input,
  accumulating the error against the BF16 output per denoising step (the *local* scores). Each
  transformer call is also run again with every Linear at W4A4, and at W4A8, and the transformer
  outputs compared with the BF16 one (the *step* scores: what running that step W4A8 gains).

Sums are kept per (Linear, step, precision) in float64 and summed over the ranks of the world
group when read (:meth:`~TuneExtension.mxfp4_tune_stats`): tensor-parallel shards add up to the
whole layer's output (a row-parallel shard's partial sums count as its share), CFG and sequence
parallel ranks add their branches and tokens.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

from ..config import Precision
from ..inspection.engine import TransformerReportExtension, world_group
from ..omni.linear import CheckedUnquantizedLinearMethod, MxLinearMethod
from ..steps import current_denoise_step

logger = logging.getLogger(__name__)

TUNE_EXTENSION = "vllm_omni_mxfp4.tune.engine.TuneExtension"
"""Qualified name to pass as ``Omni(worker_extension_cls=...)`` (it also answers the engine report)."""

SETUP_RPC = "mxfp4_tune_setup"
PLAN_RPC = "mxfp4_tune_plan"
STATS_RPC = "mxfp4_tune_stats"

BF16, W4A8, W4A4 = Precision.BF16.value, Precision.W4A8.value, Precision.W4A4.value
PRECISIONS = (BF16, W4A8, W4A4)
SUMS = ("err", "ref", "dot", "out")
"""Per (Linear or transformer, step, precision): sum of squared error against BF16, of the BF16
output squared, of their product, of the quantized output squared."""

_BLOCK = re.compile(r"(?:^|\.)(\d+)\.")


def block_of(layer: str) -> int | None:
    """The index of the first numbered module in a runtime Linear path (``blocks.3.attn1.to_qkv`` -> 3)."""
    match = _BLOCK.search(layer)
    return int(match.group(1)) if match else None


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A transformer's prediction: the output, the first of a tuple, or ``.sample``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    sample = getattr(output, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


class _Sums:
    """Error sums keyed by (name, step, precision)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int, str], list[float]] = defaultdict(lambda: [0.0] * len(SUMS))

    def add(self, name: str, step: int, precision: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        o, r = out.detach().double(), ref.detach().double()
        d = o - r
        sums = self.values[(name, step, precision)]
        for i, value in enumerate(((d * d).sum(), (r * r).sum(), (o * r).sum(), (o * o).sum())):
            sums[i] += float(value)

    def items(self) -> list[tuple[str, int, str, list[float]]]:
        return [(name, step, prec, sums) for (name, step, prec), sums in sorted(self.values.items())]


class Tuner:
    """The plan and the sums of one worker process (one per process: :data:`TUNER`)."""

    def __init__(self) -> None:
        self.layers: dict[str, str] = {}
        self.default = W4A4
        self.a8_steps: frozenset[int] = frozenset()
        self.scoring = False
        self.forced: str | None = None  # a probe re-run: every Linear at this precision
        self.local = _Sums()
        self.steps = _Sums()
        self.w4a8_components: set[str] = set()  # components with a Linear that can run W4A8

    def precision(self, key: str, step: int | None) -> str:
        """How Linear ``key`` (``component/layer``) runs at ``step`` under the current plan."""
        if self.forced is not None:
            return self.forced
        precision = self.layers.get(key, self.default)
        if precision == W4A4 and step is not None and step in self.a8_steps:
            return W4A8
        return precision


TUNER = Tuner()


class TunedLinearMethod:
    """In front of one :class:`MxLinearMethod`: runs the layer as :data:`TUNER` says, scores it in a
    scoring pass. Every other attribute is the wrapped method's (the engine report reads them)."""

    def __init__(self, inner: MxLinearMethod, key: str, w4a8: bool) -> None:
        self.inner = inner
        self.key = key
        self.w4a8 = w4a8
        self._shadow: tuple[torch.nn.Module, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        step = current_denoise_step()
        if TUNER.scoring and TUNER.forced is None:
            return self._score(layer, x, bias, -1 if step is None else step)
        precision = TUNER.precision(self.key, step)
        if precision == BF16:
            return self.bf16(layer, x, bias)
        if precision == W4A8 and not self.w4a8:
            precision = W4A4  # a probe of W4A8 over a DualScale layer: it has no W4A8
        return self.inner.forward(layer, x, bias, Precision(precision))

    def _score(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        ref = self.bf16(layer, x, bias)
        TUNER.local.add(self.key, step, W4A4, self.inner.forward(layer, x, bias, Precision.W4A4), ref)
        if self.w4a8:
            TUNER.local.add(self.key, step, W4A8, self.inner.forward(layer, x, bias, Precision.W4A8), ref)
        return ref

    def bf16(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's BF16 output: vLLM's unquantized method on the kept weight."""
        if self._shadow is None:
            weight = layer._mx.bf16_weight
            if weight is None:
                raise RuntimeError(
                    f"{self.inner.prefix}: no BF16 weight was kept; tune quantizes a BF16 checkpoint online "
                    "with VLLM_OMNI_MXFP4_KEEP_BF16=1 (an offline checkpoint has no BF16 weights to fall back to)"
                )
            holder = torch.nn.Module()
            holder.weight = torch.nn.Parameter(weight.to(x.device), requires_grad=False)
            method = UnquantizedLinearMethod()
            method.process_weights_after_loading(holder)
            self._shadow = (holder, method)
        holder, method = self._shadow
        return method.apply(holder, x, bias)

    def drop_bf16(self) -> None:
        """Free the BF16 layer built for this Linear (its host copy stays)."""
        self._shadow = None


def _transformers(pipeline: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, module)
        for name, module in pipeline.named_children()
        if name.startswith("transformer") and module is not None
    ]


class TuneExtension(TransformerReportExtension):
    """vLLM worker extension of the tuning engine (also answers the transformer report)."""

    def _tuned(self) -> dict[str, TunedLinearMethod]:
        return getattr(self, "_mxfp4_tuned", {})

    def mxfp4_tune_setup(self) -> dict[str, Any]:
        """Wrap every MXFP4 Linear of each transformer (idempotent); the units tune may choose among:
        per quantized Linear its component, runtime name, method, full (N, K), whether it can run
        W4A8; and the Linears the config already keeps in BF16 (a family default)."""
        tuned = self._tuned()
        units, kept = [], []
        for component, module in _transformers(self.model_runner.pipeline):
            for name, sub in module.named_modules():
                if not isinstance(sub, LinearBase):
                    continue
                method = sub.quant_method
                if isinstance(method, CheckedUnquantizedLinearMethod):
                    kept.append({"component": component, "layer": name, "reason": method.route.reason})
                    continue
                inner = method.inner if isinstance(method, TunedLinearMethod) else method
                if not isinstance(inner, MxLinearMethod):
                    continue
                key = f"{component}/{name}"
                if key not in tuned:
                    w4a8 = inner.method_name == "mxfp4" and bool(sub._mx.kernel.w4a8)
                    tuned[key] = TunedLinearMethod(inner, key, w4a8)
                    sub.quant_method = tuned[key]
                units.append(
                    {
                        "component": component,
                        "layer": name,
                        "method": inner.method_name,
                        "n": int(sub.output_size),
                        "k": int(sub.input_size),
                        "block": block_of(name),
                        "w4a8": tuned[key].w4a8,
                        "route": inner.route.precision.value,
                    }
                )
            if any(u["w4a8"] for u in units if u["component"] == component):
                TUNER.w4a8_components.add(component)
            if not getattr(module, "_mxfp4_tune_hooked", False):
                module.register_forward_hook(_step_probe(component), with_kwargs=True)
                module._mxfp4_tune_hooked = True
        self._mxfp4_tuned = tuned
        return {"units": units, "kept": kept}

    def mxfp4_tune_plan(self, plan: dict[str, Any]) -> int:
        """Set how the next generations run, and clear the sums: ``plan`` has ``layers``
        (``component/layer`` -> ``bf16``/``w4a8``/``w4a4``), ``default`` (the others), ``a8_steps``
        (W4A4 Linears run W4A8 on these steps) and ``scoring`` (a scoring pass). The number of
        Linears the plan names."""
        tuned = self._tuned()
        layers = dict(plan.get("layers", {}))
        unknown = sorted(set(layers) - set(tuned))
        if unknown:
            raise ValueError(f"tune plan names Linears that are not quantized in this engine: {unknown[:5]}")
        bad = sorted({p for p in (*layers.values(), plan.get("default", W4A4)) if p not in PRECISIONS})
        if bad:
            raise ValueError(f"tune plan precisions {bad}: expected one of {', '.join(PRECISIONS)}")
        TUNER.layers, TUNER.default = layers, plan.get("default", W4A4)
        TUNER.a8_steps = frozenset(int(s) for s in plan.get("a8_steps", ()))
        TUNER.scoring, TUNER.forced = bool(plan.get("scoring", False)), None
        TUNER.local, TUNER.steps = _Sums(), _Sums()
        for key, method in tuned.items():
            if not TUNER.scoring and TUNER.layers.get(key, TUNER.default) != BF16:
                method.drop_bf16()
        return len(layers)

    def mxfp4_tune_stats(self) -> dict[str, list]:
        """The sums since the last plan, summed over the world group's ranks: ``local`` rows
        ``[component/layer, step, precision, err, ref, dot, out]``, ``steps`` rows the same with the
        component in place of the Linear."""
        local = {"local": TUNER.local.items(), "steps": TUNER.steps.items()}
        world = world_group()
        if world is None or world.world_size == 1:
            return {k: [[*row[:3], *row[3]] for row in v] for k, v in local.items()}
        gathered: list[Any] = [None] * world.world_size
        torch.distributed.all_gather_object(gathered, local, group=world.cpu_group)
        merged: dict[str, dict[tuple, list[float]]] = {"local": {}, "steps": {}}
        for rank in gathered:
            for kind, rows in rank.items():
                for name, step, prec, sums in rows:
                    acc = merged[kind].setdefault((name, step, prec), [0.0] * len(SUMS))
                    for i, value in enumerate(sums):
                        acc[i] += value
        return {kind: [[*key, *sums] for key, sums in sorted(rows.items())] for kind, rows in merged.items()}


def _step_probe(component: str):
    """A forward hook that, in a scoring pass, runs the transformer call again with every Linear at
    W4A4 and at W4A8 and adds the error of each prediction against the BF16 one to the step sums."""

    def probe(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not TUNER.scoring or TUNER.forced is not None:
            return None
        ref = _first_tensor(output)
        if ref is None:
            return None
        step = current_denoise_step()
        step = -1 if step is None else step
        for precision in (W4A4, W4A8) if component in TUNER.w4a8_components else (W4A4,):
            TUNER.forced = precision
            try:
                with torch.no_grad():
                    alt = _first_tensor(module(*args, **kwargs))
            finally:
                TUNER.forced = None
            if alt is not None:
                TUNER.steps.add(component, step, precision, alt, ref)
        return None

    return probe
