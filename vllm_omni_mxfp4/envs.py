"""Every ``VLLM_OMNI_MXFP4_*`` environment variable, read in one place, validated, documented.

Each variable is declared once in :data:`VARIABLES` with its default, its accepted values and what
it does. Values are read when asked for (never cached at import), so a variable set after the
package was imported still takes effect in the next engine or layer that reads it. A bad value
raises ``ValueError`` naming the variable, the value and what is accepted.

Read them through the accessor functions (``envs.backend()``, ``envs.trace_file()``, ...); the
table is what ``docs/`` renders and what the tests check every accessor against.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import BACKENDS

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, default (the raw text used when unset or empty), parser and meaning."""

    name: str
    default: str
    accepted: str
    doc: str
    parse: Callable[[str, str], Any]

    def read(self) -> Any:
        raw = os.environ.get(self.name, "").strip()
        return self.parse(self.name, raw or self.default)


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"{name}={raw!r} is not valid: expected one of {', '.join(choices)}")
        return value

    return parse


def _flag(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not valid: expected one of {', '.join(_TRUE + _FALSE)}")


def _platform_mode(name: str, raw: str) -> str:
    value = raw.lower()
    if value == "auto":
        return "auto"
    if value in ("1", "on", "true", "force"):
        return "on"
    if value in ("0", "off", "false"):
        return "off"
    raise ValueError(
        f"{name}={raw!r} is not valid: expected 'auto', '1'/'on'/'true' (force) or '0'/'off'/'false'"
    )


def _positive_int_or_none(name: str, raw: str) -> int | None:
    if not raw:
        return None
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{name}={raw!r} is not valid: expected a positive integer")
    return count


def _warmup_size(name: str, raw: str) -> int:
    try:
        size = int(raw)
    except ValueError:
        size = -1
    if size < 0 or size % 16:
        raise ValueError(
            f"{name}={raw!r} is not valid: expected 0 (upstream's warm-up size) or a positive multiple of 16"
        )
    return size


def _text(name: str, raw: str) -> str | None:
    return raw or None


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


BACKEND = EnvVar(
    "VLLM_OMNI_MXFP4_BACKEND",
    "auto",
    "auto, " + ", ".join(BACKENDS),
    "What a config's `backend: auto` resolves to, in every process. vLLM-Omni rebuilds an offline "
    "checkpoint's config from its config.json, whose backend is always auto; this chooses there too.",
    _choice("auto", *BACKENDS),
)
EMULATED_MIRROR = EnvVar(
    "VLLM_OMNI_MXFP4_EMULATED_MIRROR",
    "npu",
    "npu, rocm, rocm:<rule> (rceil, aiter_legacy, even, floor)",
    "Whose numerics the emulated backend reproduces: the NPU kernels (default) or the ROCm AITER "
    "kernels with the given scale rule (`rocm` alone is `rocm:rceil`).",
    _choice("npu", "rocm", "rocm:rceil", "rocm:aiter_legacy", "rocm:even", "rocm:floor"),
)
EMULATED_CACHE = EnvVar(
    "VLLM_OMNI_MXFP4_EMULATED_CACHE",
    "1",
    "1/true/yes/on, 0/false/no/off",
    "Emulated backend: keep each layer's dequantized weight (4x the packed bytes for single scale) "
    "instead of dequantizing it on every call.",
    _flag,
)
EMULATED_COMPUTE = EnvVar(
    "VLLM_OMNI_MXFP4_EMULATED_COMPUTE",
    "auto",
    "auto, float32",
    "Emulated backend GEMM dtype: `auto` (bf16 for bf16 single-scale layers, float32 otherwise) or "
    "`float32` (bit-exact against the float32 reference).",
    _choice("auto", "float32"),
)
TRACE_FILE = EnvVar(
    "VLLM_OMNI_MXFP4_TRACE_FILE",
    "",
    "a file path",
    "Append one JSON line per quantized Linear call (layer, step, precision, backend) to this file, "
    "from every engine process.",
    _text,
)
TRAJECTORY_DIR = EnvVar(
    "VLLM_OMNI_MXFP4_TRAJECTORY_DIR",
    "",
    "a directory",
    "Save the latents of every denoising step (rank 0, one .npy per step, numbered per process) into this "
    "directory; what `vllm-omni-mxfp4 compare` measures each step on.",
    _text,
)
KEEP_BF16 = EnvVar(
    "VLLM_OMNI_MXFP4_KEEP_BF16",
    "0",
    "1/true/yes/on, 0/false/no/off",
    "Online quantization keeps each quantized Linear's BF16 weight (in host memory, beside the packed "
    "one) so that any layer can run in BF16 later; what `vllm-omni-mxfp4 tune` sets for its engine.",
    _flag,
)
CPU_PLATFORM = EnvVar(
    "VLLM_OMNI_MXFP4_CPU_PLATFORM",
    "auto",
    "auto, 1/on/true/force, 0/off/false",
    "The CPU platform for vLLM-Omni: `auto` activates it when no accelerator is present; force it on or off.",
    _platform_mode,
)
CPU_DEVICES = EnvVar(
    "VLLM_OMNI_MXFP4_CPU_DEVICES",
    "",
    "a positive integer",
    "Virtual devices (tensor-parallel ranks) the CPU platform reports; default: the usable CPU cores.",
    _positive_int_or_none,
)
CPU_VISIBLE_DEVICES = EnvVar(
    "VLLM_OMNI_MXFP4_CPU_VISIBLE_DEVICES",
    "",
    "a comma-separated device list",
    "The CPU platform's device-control variable; vLLM-Omni writes it per stage (not for users).",
    _text,
)
CPU_WARMUP_SIZE = EnvVar(
    "VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE",
    "64",
    "0, or a positive multiple of 16",
    "CPU platform: the largest height and width of the warm-up request a diffusion engine runs when it "
    "starts (upstream: 512x512); `0` keeps upstream's size.",
    _warmup_size,
)
CACHE = EnvVar(
    "VLLM_OMNI_MXFP4_CACHE",
    "~/.cache/vllm-omni-mxfp4",
    "a directory",
    "Where the demo and the tests cache the tiny models they build, and the merge the runtime names it "
    "derived from a vLLM-Omni class (keyed by the class, its config, the tensors and the versions).",
    _path,
)

VARIABLES: tuple[EnvVar, ...] = (
    BACKEND,
    EMULATED_MIRROR,
    EMULATED_CACHE,
    EMULATED_COMPUTE,
    TRACE_FILE,
    TRAJECTORY_DIR,
    KEEP_BF16,
    CPU_PLATFORM,
    CPU_DEVICES,
    CPU_VISIBLE_DEVICES,
    CPU_WARMUP_SIZE,
    CACHE,
)


def backend() -> str:
    """``VLLM_OMNI_MXFP4_BACKEND``: ``auto``, ``npu``, ``rocm`` or ``emulated``."""
    return BACKEND.read()


def emulated_mirror() -> str:
    """``VLLM_OMNI_MXFP4_EMULATED_MIRROR``: ``npu`` or ``rocm:<rule>`` (``rocm`` means ``rocm:rceil``)."""
    value = EMULATED_MIRROR.read()
    return "rocm:rceil" if value == "rocm" else value


def emulated_cache() -> bool:
    """``VLLM_OMNI_MXFP4_EMULATED_CACHE``: keep dequantized weights (default on)."""
    return EMULATED_CACHE.read()


def emulated_compute() -> str:
    """``VLLM_OMNI_MXFP4_EMULATED_COMPUTE``: ``auto`` or ``float32``."""
    return EMULATED_COMPUTE.read()


def trace_file() -> str | None:
    """``VLLM_OMNI_MXFP4_TRACE_FILE``: the trace path, or ``None`` when tracing is off."""
    return TRACE_FILE.read()


def trajectory_dir() -> str | None:
    """``VLLM_OMNI_MXFP4_TRAJECTORY_DIR``: where each denoising step's latents go, or ``None``."""
    return TRAJECTORY_DIR.read()


def keep_bf16() -> bool:
    """``VLLM_OMNI_MXFP4_KEEP_BF16``: online quantization keeps the BF16 weights (default off)."""
    return KEEP_BF16.read()


def cpu_platform_mode() -> str:
    """``VLLM_OMNI_MXFP4_CPU_PLATFORM``: ``auto``, ``on`` or ``off``."""
    return CPU_PLATFORM.read()


def cpu_devices() -> int | None:
    """``VLLM_OMNI_MXFP4_CPU_DEVICES``: the configured device count, or ``None``."""
    return CPU_DEVICES.read()


def cpu_visible_devices() -> str | None:
    """``VLLM_OMNI_MXFP4_CPU_VISIBLE_DEVICES``: the raw list vLLM-Omni wrote, or ``None``."""
    return CPU_VISIBLE_DEVICES.read()


def cpu_warmup_size() -> int:
    """``VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE``: the CPU platform's warm-up height/width cap (0: upstream's)."""
    return CPU_WARMUP_SIZE.read()


def cache_dir() -> Path:
    """``VLLM_OMNI_MXFP4_CACHE``: where tiny models and derived runtime names are cached."""
    return CACHE.read()
