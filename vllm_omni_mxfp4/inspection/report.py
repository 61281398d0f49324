"""What ``vllm-omni-mxfp4 inspect`` found, as data, a table and JSON (pure Python).

One :class:`ComponentReport` per transformer directory: the method auto-detection picks and the
backend-independent facts of its config, then a :class:`LayerRow` per runtime Linear of the model
class (format, precision, Smooth, the checkpoint tensors that feed it with their dtypes and shapes)
and every problem, each naming the layer and the tensor. :meth:`InspectReport.to_dict` and
:func:`format_table` show the same facts.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

PRECISION_LABELS = {"bf16": "BF16", "w4a4": "W4A4", "w4a8": "W4A8", "w8a8": "W8A8"}
#: The order tensors are listed in: the formats' checkpoint tables, weight first.
ROLE_ORDER = (
    "weight",
    "weight_scale",
    "weight_dual_scale",
    "mul_scale",
    "svd_lowrank_l1",
    "svd_lowrank_l2",
    "bias",
)


@dataclass(frozen=True)
class TensorRow:
    """One checkpoint tensor that feeds a runtime Linear (``piece``: its fused piece, if any)."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    piece: Any = None

    def describe(self) -> str:
        return f"{self.role} {self.dtype} {list(self.shape)}"


@dataclass
class LayerRow:
    """One runtime Linear: how it runs, what the checkpoint holds for it, what is wrong with it."""

    name: str
    kind: str
    method: str
    precision: str
    reason: str
    shape: tuple[int, int]
    smooth: bool | None = None
    sources: list[str] = field(default_factory=list)
    tensors: list[TensorRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``W4A4``, ``W4A8 on steps [0, 19]``, ``BF16``..."""
        return PRECISION_LABELS.get(self.precision, self.precision)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        out["tensors"] = [dict(asdict(t), shape=list(t.shape)) for t in self.tensors]
        return out


@dataclass
class ComponentReport:
    """One component (transformer directory) of the inspected path."""

    name: str
    path: str
    class_name: str | None = None
    model_module: str | None = None
    source: str = ""
    method: str | None = None
    mode: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    #: The rule the layer lists were checked under (``vllm_omni_mxfp4.config.names``), when they list any.
    names_rule: str | None = None
    layers: list[LayerRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def all_problems(self) -> list[str]:
        """Component-level problems, then each layer's, prefixed with the layer."""
        return self.problems + [f"{row.name}: {p}" for row in self.layers for p in row.problems]

    def summary(self) -> str:
        """``16 Linears: 8 mxfp4 W4A4, 8 BF16; 0 problems``."""
        counts = Counter(
            row.label if row.method == "bf16" else f"{row.method} {row.label}" for row in self.layers
        )
        parts = ", ".join(f"{n} {what}" for what, n in counts.most_common())
        problems = len(self.all_problems())
        return f"{len(self.layers)} Linears: {parts or 'none'}; {problems} problem{'s' * (problems != 1)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "class": self.class_name,
            "model_module": self.model_module,
            "source": self.source,
            "method": self.method,
            "mode": self.mode,
            "facts": self.facts,
            "names_rule": self.names_rule,
            "summary": self.summary(),
            "linears": [row.to_dict() for row in self.layers],
            "problems": self.all_problems(),
            "notes": self.notes,
        }


@dataclass
class InspectReport:
    """Every inspected component of ``path``; ``ok`` when none has a problem."""

    path: str
    components: list[ComponentReport] = field(default_factory=list)
    #: Problems of the path itself (an unreadable ``model_index.json``).
    errors: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return self.errors + [f"{c.name}: {p}" for c in self.components for p in c.all_problems()]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        n = len(self.problems)
        verdict = "OK" if n == 0 else f"{n} problem{'s' * (n != 1)}"
        return f"{self.path}: {len(self.components)} component(s) inspected, {verdict}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "summary": self.summary(),
            "components": [c.to_dict() for c in self.components],
            "problems": self.problems,
        }


def _tensor_text(row: LayerRow) -> str:
    """``weight U8 [512, 256], weight_scale U8 [512, 16] x3 (to_q, to_k, to_v)``: roles once, with
    the fused pieces' count."""
    roles: dict[str, list[TensorRow]] = {}
    for t in row.tensors:
        roles.setdefault(t.role, []).append(t)
    parts = []
    order = {role: i for i, role in enumerate(ROLE_ORDER)}
    for role, found in sorted(roles.items(), key=lambda item: (order.get(item[0], len(order)), item[0])):
        first = found[0]
        times = f" x{len(found)}" if len(found) > 1 else ""
        parts.append(f"{role} {first.dtype} {list(first.shape)}{times}")
    return ", ".join(parts) or "(no tensors)"


def _fact_text(value: Any) -> str:
    """A config value as JSON; a long list as its first entries and its length (``--json`` has all)."""
    if isinstance(value, list) and len(value) > 4:
        shown = ", ".join(json.dumps(v) for v in value[:3])
        return f"[{shown}, ...] ({len(value)} entries)"
    return json.dumps(value)


def _component_lines(c: ComponentReport) -> list[str]:
    head = f"{c.name}  ({c.class_name or 'unknown class'}, {c.path})"
    lines = [head, f"  checkpoint: {c.source}"]
    if c.method:
        lines.append(f"  method: {c.method} {c.mode or ''}".rstrip())
    lines.extend(f"  {key}: {_fact_text(value)}" for key, value in c.facts.items())
    if c.names_rule:
        lines.append(f"  layer names checked as {c.names_rule}")
    if c.layers:
        width = max(len(row.name) for row in c.layers)
        lines.append(
            f"  {'layer':<{width}}  {'N x K':>11}  {'format':<15}  {'precision':<9}  smooth  tensors"
        )
        for row in c.layers:
            smooth = "-" if row.smooth is None else ("yes" if row.smooth else "no")
            size = f"{row.shape[0]}x{row.shape[1]}"
            lines.append(
                f"  {row.name:<{width}}  {size:>11}  {row.method:<15}  {row.label:<9}  {smooth:<6}  "
                f"{_tensor_text(row)}{'' if row.reason == 'W4A4' else f'  <- {row.reason}'}"
            )
    lines.extend(f"  note: {note}" for note in c.notes)
    lines.extend(f"  problem: {p}" for p in c.all_problems())
    lines.append(f"  {c.summary()}")
    return lines


def format_table(report: InspectReport) -> str:
    """The human-readable report: one block per component, then the summary line."""
    lines = [f"problem: {error}" for error in report.errors]
    for component in report.components:
        lines.extend(_component_lines(component))
        lines.append("")
    lines.append(report.summary())
    return "\n".join(lines)
