"""One write loop for a rewritten pipeline: checks of the target, the copy of every other file, each
rewritten component written into a staging directory, and the rename into place.

The merge (msModelSlim export -> diffusers) and the convert (NVFP4 -> MXFP4) write the same kind of
output: a copy of a diffusers pipeline (or one component directory) in which some components are
replaced. Both plan first (headers only), then call :func:`publish`, so a refusal, an error or an
interruption leaves no output (:mod:`.staging`). A component to write is a :class:`ComponentOutput`;
its report (anything with ``files``, ``bytes_out`` and ``seconds``, :class:`WrittenReport`) is
filled in as it is written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from ..errors import CheckpointError, require_regular_file
from ..safetensors_io import WEIGHTS_BASENAME, OutputTensor, copy_range, write_checkpoint
from . import staging

logger = logging.getLogger(__name__)

SKIPPED_DIRS = frozenset({".git", ".cache"})
"""Directories of a pipeline that are never copied (version control, download caches)."""

Progress = Callable[[int], None]


class WrittenReport(Protocol):
    """What the writer fills in on a component's report."""

    files: list[str]
    bytes_out: int
    seconds: float


@dataclass
class ComponentOutput:
    """One component directory to write (``folder``: its name in the output, ``.`` for the output
    itself): weight shards, ``config.json``, other JSON files, and files copied from the input."""

    folder: str
    report: WrittenReport
    shards: list[list[OutputTensor]]
    config: dict
    json_files: dict[str, Any] = field(default_factory=dict)
    extra_files: list[Path] = field(default_factory=list)
    #: Called when the weights are written, whatever happens (a reader's open files).
    close: Callable[[], None] | None = None
    #: Called after the files are written (fills in what only the written bytes say).
    finished: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of its weight tensors (the progress bar's share)."""
        return sum(t.nbytes for shard in self.shards for t in shard)


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def check_output(output: Path, inputs: list[Path], overwrite: bool) -> None:
    """Refuse an output that overlaps an input, exists without ``overwrite`` (or is not a directory),
    or whose parent is missing: checked before any work, so a bad target costs nothing."""
    resolved = output.resolve()
    for path in inputs:
        source = path.resolve()
        if _inside(resolved, source) or _inside(source, resolved):
            raise CheckpointError(f"output path {output} overlaps the input {path}")
    if output.exists() or output.is_symlink():
        if not overwrite:
            raise CheckpointError(f"output path {output} exists; pass --overwrite to replace it")
        if not output.is_dir():
            raise CheckpointError(f"output path {output} exists and is not a directory")
    if not output.parent.is_dir():
        raise CheckpointError(f"the parent directory of the output path, {output.parent}, does not exist")


def component_files(original: Path, replaced: set[str]) -> list[Path]:
    """Every file of the pipeline except the ``replaced`` components (relative paths); each must be a
    regular file (a FIFO or a device is refused before anything is opened)."""
    files = []
    for root, dirs, names in os.walk(original, followlinks=True):
        rel = Path(root).relative_to(original)
        dirs[:] = sorted(
            d for d in dirs if d not in SKIPPED_DIRS and not (rel == Path(".") and d in replaced)
        )
        for name in sorted(names):
            require_regular_file(Path(root) / name)
            files.append(rel / name)
    return files


def copy_file(src: Path, dst: Path, progress: Progress) -> int:
    """Copy one file in bounded chunks (a signal is handled between chunks, even for a huge file)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        size = os.fstat(fin.fileno()).st_size
        copy_range(fin, 0, size, fout, progress, str(src))
    shutil.copymode(src, dst)
    return size


def handle_stale_staging(output: Path, dry_run: bool) -> list[str]:
    """Staging directories left by killed runs (any target, see :mod:`.staging`): removed, or in a
    dry run only reported. Runs first, so that even a run that fails validation cleans them."""
    if not dry_run:
        return [str(p) for p in staging.remove_stale(output)]
    found = [str(p) for p in staging.stale_dirs(output)]
    for path in found:
        logger.warning("%s was left by an interrupted run; the next run (not --dry-run) removes it", path)
    return found


def write_component(component: ComponentOutput, out_dir: Path, progress: Progress) -> None:
    """Write one component into ``out_dir`` and fill in its report: the files written, every byte
    under the directory (subdirectories included), the seconds it took."""
    start = time.perf_counter()
    out_dir.mkdir(exist_ok=True)
    try:
        files = write_checkpoint(out_dir, WEIGHTS_BASENAME, component.shards, progress)
    finally:
        if component.close is not None:
            component.close()
    (out_dir / "config.json").write_text(json.dumps(component.config, indent=2) + "\n")
    for name, data in component.json_files.items():
        (out_dir / name).write_text(json.dumps(data, indent=2) + "\n")
    for extra in component.extra_files:
        if extra.is_dir():
            shutil.copytree(extra, out_dir / extra.name)
        else:
            copy_file(extra, out_dir / extra.name, progress)
    report = component.report
    report.files = [*files, "config.json", *component.json_files, *(p.name for p in component.extra_files)]
    report.bytes_out = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    report.seconds = round(time.perf_counter() - start, 3)
    if component.finished is not None:
        component.finished()


def publish(
    source: Path,
    output: Path,
    copies: list[Path],
    components: list[ComponentOutput],
    *,
    desc: str,
    progress: bool | None,
    overwrite: bool,
) -> None:
    """Copy ``copies`` (paths relative to ``source``) and write ``components`` into a staging
    directory beside ``output``, then rename it into place. On any failure or interruption the staging
    directory is deleted and nothing is published. ``progress``: a tqdm bar on stderr (``None``: only
    on a terminal)."""
    total = sum((source / rel).stat().st_size for rel in copies) + sum(c.nbytes for c in components)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
               disable=None if progress is None else not progress)  # fmt: skip
    stage = staging.create(output)
    try:
        with bar:
            for rel in copies:
                copy_file(source / rel, stage / rel, bar.update)
            for component in components:
                bar.set_description(f"{desc} {component.folder}")
                write_component(component, stage / component.folder, bar.update)
        staging.publish(stage, output, overwrite)
    except BaseException:
        staging.discard(stage)
        raise
