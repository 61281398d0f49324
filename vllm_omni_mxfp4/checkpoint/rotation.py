"""msModelSlim's online Q/K rotation records (QuaRot), accepted only where serving without them is exact.

msModelSlim's shipped Wan2.2 and Qwen-Image-Edit recipes run ``online_quarot``: the adapter hangs
``q_rot`` and ``k_rot`` (``nn.Identity``, replaced by an ``OnlineRotationWrapper``) on every attention
the recipe's ``include`` selects (Wan: ``blocks.N.self_attn``; Qwen-Image: the block
``transformer_blocks.N``, rotating its joint image and text Q/K), and the ``mindie_format`` saver
stores their Hadamard matrix as ``<owner>.q_rot`` / ``k_rot`` (FLOAT, ``(head_dim, head_dim)``). The rotation multiplies Q
and K inside MindIE-SD's quantized attention; no stored weight is rotated. vLLM-Omni runs attention
in BF16 without it, which computes the original model's attention, so the merge accepts these
records, keeps them out of the weights and records them in the merged config
(``quantization_config.online_rotation``, informational).

Accepted only in that case, checked before anything is written (each violation names the records):

- the records are ``q_rot`` / ``k_rot`` of a module that holds an attention's Q and K projections in
  the model (:meth:`~.names.ModelNames.attention`, from vLLM-Omni's class), both present and equal, square of the model's ``attention_head_dim``, finite and orthogonal;
- the attention's Q and K weights were not rotated: each decodes (MXFP4 / MXFP8 / BF16) to values
  close to the original's (cosine similarity, far above what a rotation leaves).

Any other rotation record (``v_rot``, a rotation on a Linear, an offline rotation's leftovers) is
refused, naming it: it would change the model if dropped, and the runtime does not apply rotations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_omni_mxfp4 import spec

from ..errors import CheckpointError, read_json_object
from ..safetensors_io import TensorRef, decode_array

#: The rotation records msModelSlim's adapters register (``get_online_rotation_configs``).
ROTATION_LEAVES = ("q_rot", "k_rot")
#: ``R R^T`` of a BF16-stored orthogonal matrix is within this of the identity (measured 2.2e-4 at 128).
ORTHOGONALITY_TOLERANCE = 1e-2
#: Q/K weights decoded from the export against the original: quantization keeps the cosine above
#: 0.97 (MXFP4 on Gaussian weights: 0.995), a rotation of the weight drops it to about 0.
UNROTATED_COSINE = 0.9
#: Rows of each Q/K weight compared (bounds the read on a 14B model).
ROWS_COMPARED = 256
REASON = (
    "msModelSlim online rotation of Q and K for its quantized attention (no stored weight is rotated); "
    "vLLM-Omni runs attention in BF16 without it, which is the original model's attention"
)


def is_rotation_record(name: str) -> bool:
    """Whether an export tensor name is an online rotation record (``..._rot``)."""
    return name.rsplit(".", 1)[-1].endswith("rot")


@dataclass
class Rotations:
    """The rotation records of one export, by export module (``blocks.N.self_attn``,
    ``transformer_blocks.N``). ``attention`` maps such a module to its runtime attention and the
    diffusers Q/K Linears it holds (:meth:`~.names.ModelNames.attention`)."""

    description: Path
    attention: Callable[[str], tuple[str, list[str]]]
    records: dict[str, dict[str, TensorRef]] = field(default_factory=dict)

    def add(self, name: str, ref: TensorRef) -> None:
        """File one record, or refuse it naming why it cannot be served."""
        owner, _, leaf = name.rpartition(".")
        why = None
        if leaf not in ROTATION_LEAVES:
            why = "not a q_rot/k_rot"
        else:
            try:
                self.attention(owner)
            except CheckpointError as exc:
                why = f"a {leaf} on no attention ({exc})"
        if why is not None:
            raise CheckpointError(
                f"{self.description}: rotation record {name!r} is {why} of an attention; only "
                "msModelSlim's online Q/K rotation (recipe step 'online_quarot' on the attentions) leaves "
                "the stored weights unrotated, and vLLM-Omni applies no rotation at run time: re-export "
                "without this rotation"
            )
        self.records.setdefault(owner, {})[leaf] = ref

    def runtime_layers(self) -> list[str]:
        """The vLLM-Omni attention modules whose Q/K the records rotate (``blocks.N.attn1``)."""
        return [self.attention(owner)[0] for owner in self.records]

    def check(self, original_dir: Path, decoded: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """The records are pairs of equal orthogonal head-size matrices, and ``decoded`` (export
        Linear name -> (export values, original values) of the rotated Q/K weights) shows no rotated
        weight."""
        if not self.records:
            return
        head_dim = _head_dim(original_dir)
        for attention, pair in self.records.items():
            missing = [leaf for leaf in ROTATION_LEAVES if leaf not in pair]
            if missing:
                raise CheckpointError(
                    f"{self.description}: {attention} has {', '.join(pair)} but no {', '.join(missing)}; "
                    "msModelSlim's online QuaRot rotates Q and K with one matrix"
                )
            q, k = (_matrix(pair[leaf], head_dim) for leaf in ROTATION_LEAVES)
            if not np.array_equal(q, k):
                raise CheckpointError(
                    f"{self.description}: {attention}.q_rot and k_rot differ; only equal Q/K rotations "
                    "cancel in the attention scores, so only those can be left unapplied"
                )
        for linear, (export, original) in decoded.items():
            _check_unrotated(self.description, linear, export, original)


def _head_dim(original_dir: Path) -> int:
    path = original_dir / "config.json"
    value = read_json_object(path, if_missing="the original transformer needs its config.json").get(
        "attention_head_dim"
    )
    if not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{path}: attention_head_dim is {value!r}; expected a positive integer")
    return value


def _matrix(ref: TensorRef, head_dim: int) -> np.ndarray:
    """A rotation record's matrix, checked: float, ``(head_dim, head_dim)``, finite, orthogonal."""
    where = f"{ref.path}: rotation record {ref.name!r}"
    if ref.dtype not in spec.FLOAT_DTYPES or ref.shape != (head_dim, head_dim):
        raise CheckpointError(
            f"{where} is {ref.dtype} {list(ref.shape)}; expected a float [{head_dim}, {head_dim}] matrix "
            "(attention_head_dim of the original)"
        )
    r = ref.read_array().astype(np.float64)
    if not np.isfinite(r).all():
        raise CheckpointError(f"{where} holds NaN or Inf")
    error = float(np.abs(r @ r.T - np.eye(head_dim)).max())
    if error > ORTHOGONALITY_TOLERANCE:
        raise CheckpointError(
            f"{where} is not orthogonal (R R^T differs from the identity by up to {error:.3g}); dropping "
            "it would change attention"
        )
    return r


def _check_unrotated(description: Path, linear: str, export: np.ndarray, original: np.ndarray) -> None:
    denominator = float(np.linalg.norm(export) * np.linalg.norm(original))
    cosine = float((export * original).sum()) / denominator if denominator else 1.0
    if cosine < UNROTATED_COSINE:
        raise CheckpointError(
            f"{description}: the stored weight of {linear} differs from the original's (cosine "
            f"{cosine:.3f} < {UNROTATED_COSINE}) beyond quantization error: it was rotated offline, which "
            "vLLM-Omni cannot undo; re-export without the offline rotation (recipe step 'quarot')"
        )


def read_rows(ref: TensorRef, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a 2-D tensor as stored (``F8_E4M3`` as its uint8 codes)."""
    rows = min(rows, ref.shape[0])
    row_bytes = ref.nbytes // ref.shape[0]
    with open(ref.path, "rb") as fh:
        fh.seek(ref.offset)
        raw = fh.read(rows * row_bytes)
    if len(raw) != rows * row_bytes:
        raise CheckpointError(f"{ref.path}: tensor {ref.name!r} is truncated")
    return decode_array(raw, ref.dtype, (rows, *ref.shape[1:]))


def _e4m3_values() -> np.ndarray:
    """The 256 FP8 E4M3 (``float8_e4m3fn``) values by code (NaN for 0x7F / 0xFF)."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    magnitude = np.where(
        exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0)
    )
    magnitude = np.where((code & 0x7F) == spec.E4M3_NAN_MAGNITUDE, np.nan, magnitude)
    return np.where(code & 0x80, -magnitude, magnitude)


def _e2m1_pairs() -> np.ndarray:
    """(256, 2): the two E2M1 values of a packed byte, the even element (low nibble) first."""
    values = np.array(spec.E2M1_VALUES + tuple(-v for v in spec.E2M1_VALUES))
    byte = np.arange(256)
    return np.stack((values[byte & 0xF], values[byte >> 4]), axis=-1)


_E4M3 = _e4m3_values()
_E2M1_PAIRS = _e2m1_pairs()


def decode_rows(fmt: str, weight: TensorRef, scale: TensorRef | None, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a Linear's weight as float64 numbers: ``fmt`` ``mxfp4`` /
    ``mxfp4_dualscale`` (packed E2M1) or ``mxfp8`` (E4M3) times ``2^(scale - 127)`` per 32 along K (the
    caller applies a DualScale coarse scale), or ``bf16``: a plain float weight."""
    stored = read_rows(weight, rows)
    if fmt == "bf16":
        return stored.astype(np.float64)
    if fmt == "mxfp8":
        values = _E4M3[stored]
    else:
        values = _E2M1_PAIRS[stored].reshape(stored.shape[0], -1)
    codes = read_rows(scale, rows).astype(np.float64)
    exponents = np.repeat(codes - spec.E8M0_BIAS, spec.MX_BLOCK, axis=1)[:, : values.shape[1]]
    return values * np.exp2(exponents)
