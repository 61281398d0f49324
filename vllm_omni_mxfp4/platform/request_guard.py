"""One request must not take the server down: the memory a request needs at least, and a failure's reason.

Two rules the CPU platform's model runner (:mod:`.runner`) applies to every request before and
after the pipeline runs; this module holds them as plain functions (no torch, no vLLM-Omni).

* **Size limit.** :func:`request_size` reads a request's output size (prompts x outputs per
  prompt x frames x height x width); :meth:`RequestSize.decoded_bytes` is the memory its decoded
  frames alone take as float32, the form the VAE decodes into. That is a lower bound: latents,
  activations and the encoded file come on top. :func:`memory_limit` is the memory the platform
  reports for this process: the host's total memory (psutil), lowered to the address-space limit
  (``RLIMIT_AS``, e.g. ``ulimit -v`` or ``prlimit --as``) when one is set. :func:`oversize_reason`
  returns the refusal when the lower bound exceeds that limit, so a request that cannot fit fails
  alone, before it allocates anything, instead of being killed by the kernel with the server.
  Both numbers are the same in every tensor-parallel rank (the same request, the same host, the
  inherited limit), so the ranks refuse together and no rank waits in a collective for another.
* **Failure reason.** :func:`failure_reason` gives an exception a message that is never empty:
  vLLM-Omni carries a failed request's reason as ``str(exception)``, and an exception without a
  message (``MemoryError()``, a bare ``assert``) otherwise reaches the client as an empty reason,
  or, worse, as a "successful" request with no output.
"""

from __future__ import annotations

import resource
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

DECODED_CHANNELS = 3
"""RGB: the channels of a decoded frame."""

DECODED_BYTES_PER_VALUE = 4
"""float32: the dtype a VAE decodes into before the frames are encoded."""

_GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryLimit:
    """The memory a request may use at most, in bytes, and where the figure comes from."""

    bytes: int
    source: str


def memory_limit() -> MemoryLimit:
    """The host's total memory (psutil), or this process' ``RLIMIT_AS`` where that is lower."""
    total = MemoryLimit(int(psutil.virtual_memory().total), "the host's total memory")
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < total.bytes:
        return MemoryLimit(int(soft), "this process' address-space limit (RLIMIT_AS)")
    return total


@dataclass(frozen=True)
class RequestSize:
    """The output a request asks for: how many videos (or images), frames, and pixels per frame."""

    outputs: int
    frames: int
    height: int
    width: int

    @property
    def decoded_bytes(self) -> int:
        """Bytes of all decoded frames as float32 RGB: the least the request needs."""
        values = self.outputs * self.frames * self.height * self.width * DECODED_CHANNELS
        return values * DECODED_BYTES_PER_VALUE

    def describe(self) -> str:
        return (
            f"{self.outputs} output(s) x {self.frames} frame(s) x height {self.height} x width {self.width}"
        )


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def request_size(prompt: Any, sampling_params: Any) -> RequestSize | None:
    """The size ``sampling_params`` asks for, or None when height or width is unset (the model's
    defaults apply then, and those are the model's own business)."""
    height = _positive_int(getattr(sampling_params, "height", None))
    width = _positive_int(getattr(sampling_params, "width", None))
    if height is None or width is None:
        return None
    prompts = len(prompt) if isinstance(prompt, Sequence) and not isinstance(prompt, str | bytes) else 1
    per_prompt = _positive_int(getattr(sampling_params, "num_outputs_per_prompt", None)) or 1
    frames = _positive_int(getattr(sampling_params, "num_frames", None)) or 1
    return RequestSize(max(prompts, 1) * per_prompt, frames, height, width)


def oversize_reason(request_id: str, size: RequestSize, limit: MemoryLimit) -> str | None:
    """The refusal of a request whose decoded frames alone exceed ``limit``; None when they fit."""
    needed = size.decoded_bytes
    if needed <= limit.bytes:
        return None
    return (
        f"Request {request_id!r} is too large for this server: {size.describe()} needs at least "
        f"{needed / _GIB:.1f} GiB ({needed} bytes) for its decoded frames alone (RGB, float32), more "
        f"than the limit of {limit.bytes / _GIB:.1f} GiB ({limit.bytes} bytes), {limit.source}. "
        "Ask for fewer or smaller frames (height, width, num_frames, num_outputs_per_prompt), or serve "
        "from a machine with more memory."
    )


def failure_reason(exc: BaseException, request_id: str | None = None) -> str:
    """``str(exc)`` when it says something; else the exception's type and where it was raised."""
    text = str(exc).strip()
    if text:
        return text
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    label = "" if request_id is None else f" {request_id!r}"
    return (
        f"Request{label} failed: {type(exc).__name__} without a message{where}; "
        "the server log has the traceback."
    )
