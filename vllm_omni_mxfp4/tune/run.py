"""``vllm-omni-mxfp4 tune``: score every quantized Linear and step, choose under a budget, check.

One engine does everything (``Omni(...)`` with :data:`~.engine.TUNE_EXTENSION`, online quantization
keeping the BF16 weights, the trajectory hook recording each step's latents): the serving kernels
run every pass, and a pass is a *plan* (how every Linear runs) followed by one generation per
request. The tuning requests see:

1. the scoring pass: the BF16 model's trajectory (the reference), with each Linear's local score
   and each step's score computed on the way (run in two halves when there are two or more tuning
   requests, so that each half ranks the Linears on its own: the stability check);
2. all-W4A4 (the baseline of the end-to-end gains);
3. one pass per candidate (the units with the largest local error), each alone in W4A4;
4. the selected configuration.

That is ``candidates + 3`` passes over the tuning requests. With evaluation requests (prompts and
seeds tuning did not use), BF16, all-W4A4, the static priors and the tuned selection then run on
those, and :func:`vllm_omni_mxfp4.compare.report.measure` measures them against BF16.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .. import envs
from ..compare.report import measure, task_judge
from ..compare.run import (
    BF16,
    Config,
    ConfigRun,
    Request,
    Settings,
    check_config,
    engine_kwargs,
    environment,
    frames_of,
    fresh_dir,
    generate,
    take_steps,
)
from . import scores as sc
from .engine import PLAN_RPC, SETUP_RPC, STATS_RPC, TUNE_EXTENSION
from .select import (
    Budget,
    Selection,
    Unit,
    base_config,
    edge_prior_order,
    fill,
    first_blocks_order,
    random_order,
    select_by_gain,
    spearman,
    units_from,
)

logger = logging.getLogger(__name__)

METHODS = ("mxfp4", "mxfp4_dualscale")
RANDOM_PRIORS = 5


@dataclass
class Pass:
    """One plan over some requests: frames, trajectories, seconds."""

    label: str
    frames: list[np.ndarray] = field(default_factory=list)
    trajectories: list[list[np.ndarray]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


@dataclass
class Cost:
    """What tuning ran: passes over the tuning requests, generations, seconds."""

    tuning_passes: int = 0
    tuning_generations: int = 0
    evaluation_generations: int = 0
    engine_seconds: float = 0.0
    tuning_seconds: float = 0.0
    evaluation_seconds: float = 0.0


@dataclass
class TuneResult:
    """Everything tune measured and chose (:mod:`.report` writes it)."""

    model: str
    method: str
    budget: Budget
    settings: Settings
    tuning: list[Request]
    evaluation: list[Request]
    units: list[Unit]
    kept: dict[str, tuple[str, ...]]
    local: dict[str, sc.LocalScore]
    local_halves: list[dict[str, sc.LocalScore]]
    steps: list[sc.StepScore]
    baseline: sc.Outcome
    candidates: list[str]
    e2e: dict[str, sc.Outcome]
    e2e_per_request: dict[str, list[float]]
    gains: dict[str, float]
    selection: Selection
    tuned: sc.Outcome
    reference_trajectory_len: int
    priors: list[Selection] = field(default_factory=list)
    evaluated: list[dict[str, Any]] = field(default_factory=list)
    evaluation_runs: list[ConfigRun] = field(default_factory=list)
    stability: dict[str, float | None] = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)

    @property
    def components(self) -> list[str]:
        return sorted({u.component for u in self.units})


def _outcome(run: Pass, reference: Pass) -> sc.Outcome:
    return sc.outcome(run.frames, run.trajectories, reference.frames, reference.trajectories)


def candidate_plan(key: str) -> dict[str, Any]:
    """A candidate's end-to-end pass: the unit alone in W4A4, every other Linear BF16
    (:func:`.scores.isolated_share` says why not the other way round)."""
    return {"layers": {key: "w4a4"}, "default": "bf16"}


def candidate_gain(candidate: sc.Outcome, baseline: sc.Outcome) -> float:
    """What keeping the candidate in BF16 gains: its own share of the all-W4A4 trajectory error."""
    return sc.isolated_share(candidate, baseline)


def default_candidates(units: Sequence[Unit], local: dict[str, sc.LocalScore], budget: Budget) -> int:
    """Twice the units the budget holds when filled by local score (at least 8, at most all)."""
    order = sorted(units, key=lambda u: -local[u.key].a4.rel if u.key in local else 0.0)
    return min(len(units), max(8, 2 * len(fill(order, budget, units))))


def prior_selections(
    units: Sequence[Unit], budget: Budget, steps: Sequence[int], kept: dict[str, tuple[str, ...]]
) -> list[Selection]:
    """The static choices at the same budget: the first-N-blocks rule, the edge prior (ModelOpt's
    Wan filter: outside the blocks, then first and last blocks) and :data:`RANDOM_PRIORS` random
    picks. Each fills the W4A8 budget statically too: the next W4A8-capable units of its own order,
    and the first steps."""

    def selection(label: str, order: list[Unit]) -> Selection:
        bf16 = fill(order, budget, units)
        chosen = {u.key for u in bf16}
        w4a8 = [u.key for u in order if u.w4a8 and u.key not in chosen][: budget.w4a8_layers]
        a8_steps = tuple(sorted(steps)[: budget.w4a8_steps]) if any(u.w4a8 for u in units) else ()
        return Selection(label, tuple(u.key for u in bf16), tuple(w4a8), a8_steps, kept)

    priors = [
        selection("first-blocks", first_blocks_order(units)),
        selection("edge-prior", edge_prior_order(units)),
    ]
    priors += [selection(f"random-{i}", random_order(units, seed=i)) for i in range(RANDOM_PRIORS)]
    return priors


def choose(
    units: Sequence[Unit],
    gains: dict[str, float],
    local: dict[str, sc.LocalScore],
    step_list: Sequence[sc.StepScore],
    budget: Budget,
    kept: dict[str, tuple[str, ...]],
) -> Selection:
    """The tuned selection: BF16 units by gain under the budget; W4A8 units by local W4A8 gain among
    the rest (single scale only); W4A8 steps by step gain."""
    bf16 = select_by_gain(units, gains, budget)
    chosen = {u.key for u in bf16}
    a8_units = sorted(
        (u for u in units if u.w4a8 and u.key not in chosen and u.key in local and local[u.key].a8_gain > 0),
        key=lambda u: -local[u.key].a8_gain,
    )[: budget.w4a8_layers]
    a8_steps: tuple[int, ...] = ()
    if budget.w4a8_steps and any(u.w4a8 for u in units):
        ranked = sorted((s for s in step_list if s.gain > 0 and s.step >= 0), key=lambda s: -s.gain)
        a8_steps = tuple(sorted(s.step for s in ranked[: budget.w4a8_steps]))
    return Selection("tuned", tuple(u.key for u in bf16), tuple(u.key for u in a8_units), a8_steps, kept)


def _score_halves(
    passes: Passes, requests: Sequence[Request]
) -> tuple[Pass, list[dict[str, sc.LocalScore]], list[sc.StepScore], dict[str, sc.LocalScore]]:
    """The scoring pass, in two halves of the requests (even and odd positions) when there are two or
    more: the reference run (in the requests' order), each half's local scores, the step scores and
    the local scores of all requests."""
    n = len(requests)
    halves = [list(range(n))] if n < 2 else [list(range(0, n, 2)), list(range(1, n, 2))]
    slots: list[tuple[np.ndarray, list[np.ndarray], float] | None] = [None] * n
    local_rows: list[list] = []
    step_rows: list[list] = []
    half_scores = []
    for number, half in enumerate(halves, 1):
        label = f"scoring {number}/{len(halves)}"
        run = passes.run({"scoring": True}, label, [requests[i] for i in half])
        stats = passes.rpc(STATS_RPC)
        local_rows += stats["local"]
        step_rows += stats["steps"]
        half_scores.append(sc.local_scores(stats["local"]))
        for j, i in enumerate(half):
            slots[i] = (run.frames[j], run.trajectories[j], run.seconds[j])
    reference = Pass(BF16)
    for frames, trajectory, seconds in slots:  # type: ignore[misc]
        reference.frames.append(frames)
        reference.trajectories.append(trajectory)
        reference.seconds.append(seconds)
    return reference, half_scores, sc.step_scores(step_rows), sc.local_scores(local_rows)


def _check_arguments(
    method: str,
    tuning: Sequence[Request],
    evaluation: Sequence[Request],
    budget: Budget,
    candidates: int | None,
) -> None:
    if method not in METHODS:
        raise ValueError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if not tuning:
        raise ValueError("tune needs at least one tuning prompt and seed")
    overlap = {(r.prompt, r.seed) for r in tuning} & {(r.prompt, r.seed) for r in evaluation}
    if overlap:
        raise ValueError(
            f"evaluation requests {sorted(overlap)[:3]} are also tuning requests; give --eval-seed seeds "
            "that --seed does not list"
        )
    if candidates is not None and candidates < 1:
        raise ValueError(f"--candidates must be >= 1, got {candidates}")
    if (budget.w4a8_layers or budget.w4a8_steps) and method != "mxfp4":
        raise ValueError(
            f"--max-w4a8-layers / --max-w4a8-steps: {method} has no W4A8 fallback (only single-scale "
            "mxfp4 does); for DualScale give a BF16 budget only"
        )


def tune(
    model: str,
    method: str,
    tuning: Sequence[Request],
    settings: Settings,
    budget: Budget,
    work: Path,
    evaluation: Sequence[Request] = (),
    candidates: int | None = None,
    progress: Callable[[str], None] = logger.info,
) -> TuneResult:
    """Score, choose and check on ``tuning``; measure the choice against the priors on ``evaluation``."""
    _check_arguments(method, tuning, evaluation, budget, candidates)  # before vLLM-Omni's imports (seconds)
    from vllm_omni import Omni

    config = Config(
        "tune", {"quantization_config": base_config(method), "worker_extension_cls": TUNE_EXTENSION}
    )
    check_config(config)
    steps_dir = fresh_dir(work / "trajectory")
    started = time.perf_counter()
    variables = {envs.TRAJECTORY_DIR.name: str(steps_dir), envs.KEEP_BF16.name: "1"}
    with environment(variables):  # the whole run: an in-process worker reads them at every step
        progress(
            f"tune: starting the engine, Omni(model={model!r}, quantization_config={base_config(method)})"
        )
        omni = Omni(model=model, **engine_kwargs(model, config))
        try:
            passes = Passes(omni, model, settings, steps_dir)
            units, kept = _setup(passes)  # answered once the workers have loaded the model
            engine_seconds = time.perf_counter() - started
            take_steps(steps_dir)  # the warm-up request
            if not units:
                raise ValueError(f"{model}: the engine quantized no Linear with {method}; nothing to tune")
            result = _tune_on(passes, units, kept, method, tuning, budget, evaluation, candidates, progress)
            result.cost.engine_seconds = engine_seconds
            if evaluation:
                evaluate(passes, result, progress)
        finally:
            omni.shutdown()
    return result


@dataclass
class Passes:
    """Runs plans and control RPCs on the tuning engine."""

    omni: Any
    model: str
    settings: Settings
    steps_dir: Path

    def rpc(self, method: str, *args: Any, timeout: float = 600.0) -> Any:
        """Rank 0's answer to a control RPC of the tuning extension."""
        stack = [self.omni.engine.collective_rpc(method, timeout=timeout, args=args)]
        while stack:
            item = stack.pop(0)
            if isinstance(item, (list, tuple)):
                stack[:0] = list(item)
            elif isinstance(item, dict) and item.get("supported") is False:
                raise RuntimeError(f"the tuning engine could not run {method}: {item.get('error')}")
            elif item is not None:
                return item
        raise RuntimeError(f"no diffusion worker answered {method}")

    def run(self, plan: dict[str, Any], label: str, requests: Sequence[Request]) -> Pass:
        """Set ``plan``, then one generation per request: frames, each step's latents, seconds."""
        self.rpc(PLAN_RPC, plan)
        out = Pass(label)
        for request in tqdm(requests, desc=label, unit="generation", leave=False):
            start = time.perf_counter()
            output = generate(self.omni, request, self.settings)
            out.seconds.append(time.perf_counter() - start)
            out.frames.append(frames_of(output.images))
            out.trajectories.append(take_steps(self.steps_dir))
        return out


def _setup(passes: Passes) -> tuple[list[Unit], dict[str, tuple[str, ...]]]:
    report = passes.rpc(SETUP_RPC)
    kept: dict[str, tuple[str, ...]] = {}
    for entry in report["kept"]:
        kept[entry["component"]] = (*kept.get(entry["component"], ()), entry["layer"])
    return units_from(report), kept


def _candidate_scores(
    passes: Passes, keys: Sequence[str], tuning: Sequence[Request], reference: Pass, baseline: Pass
) -> tuple[dict[str, sc.Outcome], dict[str, list[float]]]:
    """Each candidate's pass (:func:`candidate_plan`): its outcome, and its gain per request."""
    e2e: dict[str, sc.Outcome] = {}
    per_request: dict[str, list[float]] = {}

    def one(run: Pass, i: int) -> sc.Outcome:
        return sc.outcome(
            [run.frames[i]], [run.trajectories[i]], [reference.frames[i]], [reference.trajectories[i]]
        )

    for key in tqdm(keys, desc="candidates", unit="candidate"):
        run = passes.run(candidate_plan(key), key, tuning)
        e2e[key] = _outcome(run, reference)
        per_request[key] = [candidate_gain(one(run, i), one(baseline, i)) for i in range(len(tuning))]
    return e2e, per_request


def _tune_on(
    passes: Passes,
    units: list[Unit],
    kept: dict[str, tuple[str, ...]],
    method: str,
    tuning: Sequence[Request],
    budget: Budget,
    evaluation: Sequence[Request],
    candidates: int | None,
    progress: Callable[[str], None],
) -> TuneResult:
    """The ``candidates + 3`` passes over the tuning requests on a started engine."""
    components = ", ".join(sorted({u.component for u in units}))
    progress(f"tune: {len(units)} quantized Linears in {components}; budget: {budget.describe()}")
    t0 = time.perf_counter()
    reference, halves, step_list, local = _score_halves(passes, tuning)
    baseline_pass = passes.run({"default": "w4a4"}, "all W4A4", tuning)
    baseline = _outcome(baseline_pass, reference)
    ranked = sorted(units, key=lambda u: -local[u.key].a4.rel if u.key in local else 0.0)
    chosen = [u.key for u in ranked[: candidates or default_candidates(units, local, budget)]]
    progress(
        f"tune: scored {len(local)} Linears and {len(step_list)} steps; all W4A4: final-latent MSE "
        f"{baseline.final_mse:.3g}, PSNR {baseline.psnr:.2f} dB; {len(chosen)} candidates end to end"
    )
    if all(step.step < 0 for step in step_list):
        progress(
            "tune: the pipeline publishes no denoising step index (vLLM-Omni's Wan2.2 pipelines do), so "
            "W4A8 steps cannot run here: the step scores are one row (step -1, all steps) and no W4A8 "
            "step is chosen"
        )
    e2e, per_request = _candidate_scores(passes, chosen, tuning, reference, baseline_pass)
    measured = {key: candidate_gain(outcome, baseline) for key, outcome in e2e.items()}
    gains = sc.predicted_gains(units, local, measured)
    selection = choose(units, gains, local, step_list, budget, kept)
    tuned = _outcome(passes.run(selection.plan(), "tuned", tuning), reference)
    n_passes = len(chosen) + 3
    cost = Cost(n_passes, n_passes * len(tuning), tuning_seconds=time.perf_counter() - t0)
    progress(
        f"tune: selected {len(selection.bf16)} BF16 and {len(selection.w4a8)} W4A8 Linears, W4A8 steps "
        f"{list(selection.a8_steps)}; on the tuning requests final-latent MSE {baseline.final_mse:.3g} -> "
        f"{tuned.final_mse:.3g}, PSNR {baseline.psnr:.2f} -> {tuned.psnr:.2f} dB"
    )
    result = TuneResult(
        passes.model, method, budget, passes.settings, list(tuning), list(evaluation), units, kept, local, halves,
        step_list, baseline, chosen, e2e, per_request, gains, selection, tuned,
        len(reference.trajectories[0]) if reference.trajectories else 0, cost=cost,
    )  # fmt: skip
    result.stability = stability(result)
    return result


def stability(result: TuneResult) -> dict[str, float | None]:
    """Spearman's rho between the two halves of the tuning requests: of the local scores over every
    unit, and of the end-to-end gains over the candidates (None with fewer than two requests)."""
    out: dict[str, float | None] = {"local": None, "end_to_end": None}
    if len(result.local_halves) == 2:
        a, b = result.local_halves
        keys = [u.key for u in result.units if u.key in a and u.key in b]
        if len(keys) >= 2:
            out["local"] = spearman([a[k].a4.rel for k in keys], [b[k].a4.rel for k in keys])
    if len(result.tuning) >= 2 and len(result.candidates) >= 2:
        first = [float(np.mean(result.e2e_per_request[k][::2])) for k in result.candidates]
        second = [float(np.mean(result.e2e_per_request[k][1::2])) for k in result.candidates]
        out["end_to_end"] = spearman(first, second)
    return out


def evaluate(passes: Passes, result: TuneResult, progress: Callable[[str], None] = logger.info) -> None:
    """BF16, all-W4A4, the priors and the tuned selection on the evaluation requests, measured by
    compare's measures against BF16 (prompt accuracy where a task metric knows the model)."""
    t0 = time.perf_counter()
    steps = list(range(result.reference_trajectory_len))
    result.priors = prior_selections(result.units, result.budget, steps, result.kept)
    selections = [Selection("all-w4a4", kept=result.kept), *result.priors, result.selection]
    plans = [("bf16", {"default": "bf16"})] + [(s.label, s.plan()) for s in selections]
    runs = []
    bf16_bytes = sum(u.extra_bytes for u in result.units)
    for label, plan in tqdm(plans, desc="evaluation", unit="config"):
        done = passes.run(plan, label, result.evaluation)
        run = ConfigRun(Config(label, {}), done.frames, done.trajectories, done.seconds)
        runs.append(run)
    configs = measure(runs, result.evaluation, task_judge(result.model))
    extra = {s.label: sum(u.extra_bytes for u in result.units if u.key in set(s.bf16)) for s in selections}
    for entry in configs:
        entry["bf16_extra_bytes"] = extra.get(entry["label"], bf16_bytes if entry["label"] == BF16 else 0)
        selection = next((s for s in selections if s.label == entry["label"]), None)
        entry["bf16_layers"] = None if selection is None else list(selection.bf16)
        entry["w4a8_layers"] = None if selection is None else list(selection.w4a8)
        entry["w4a8_steps"] = None if selection is None else list(selection.a8_steps)
    result.evaluated = configs
    result.evaluation_runs = runs
    result.cost.evaluation_generations = len(plans) * len(result.evaluation)
    result.cost.evaluation_seconds = time.perf_counter() - t0
    progress(f"tune: evaluated {len(plans)} configurations on {len(result.evaluation)} held-out request(s)")


def random_mean(configs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The mean of the random priors' final measures and accuracy (None without them)."""
    rows = [c for c in configs if c["label"].startswith("random-")]
    if not rows:
        return None

    def mean(values: list[float | None]) -> float | None:
        finite = [v for v in values if v is not None and not math.isnan(v)]
        return float(np.mean(finite)) if finite else None

    return {
        "label": f"random (mean of {len(rows)})",
        "final": {k: mean([c["final"][k] for c in rows]) for k in ("psnr", "ssim", "cosine")},
        "prompt_accuracy": mean([c["prompt_accuracy"] for c in rows]),
        "bf16_extra_bytes": mean([c["bf16_extra_bytes"] for c in rows]),
        "steps": [],
    }
