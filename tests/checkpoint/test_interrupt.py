"""Interruptions: a merge killed midway leaves no output directory, and the next run cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_omni_mxfp4.checkpoint import merge

# Runs the real CLI with one tensor write slowed down, so that the test can interrupt it midway.
_SLOW_MERGE = """
import sys, time, pathlib
from vllm_omni_mxfp4.checkpoint import safetensors_io
marker = pathlib.Path(sys.argv[1])
real = safetensors_io.CopyBytes.write_to
calls = []
def slow(self, out, progress):
    calls.append(1)
    if len(calls) == 40:
        marker.write_text("midway")
        time.sleep(120)
    return real(self, out, progress)
safetensors_io.CopyBytes.write_to = slow
from vllm_omni_mxfp4.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _start(tmp_path: Path, scenario, out: Path) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / "midway"
    argv = ["merge", "--model-type", "Wan2.2-T2V-A14B", "--original-model", str(scenario.original)]
    argv += ["--quant-path", str(scenario.quant), "--output-path", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_MERGE, str(marker), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out_text, err_text = proc.communicate()
            pytest.fail(f"the merge did not reach the midway point: {proc.returncode} {err_text[-2000:]}")
        time.sleep(0.05)
    return proc, marker


def _staging_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if ".mxfp4-merge-" in p.name)


def test_sigkill_midway_leaves_no_output_and_the_next_run_cleans_up(tmp_path, dual_export):
    parent = tmp_path / "models"
    parent.mkdir()
    out = parent / "merged"
    proc, _ = _start(tmp_path, dual_export, out)
    try:
        (staging,) = _staging_dirs(parent)
        assert staging.name.startswith(".merged.mxfp4-merge-staging.") and staging.name.split(".")[-2] == str(
            proc.pid
        )
        assert (staging / "transformer").is_dir()  # midway: files are being written
        assert not out.exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert _staging_dirs(parent) == [staging]  # only the recognisable staging directory is left

    report = merge("Wan2.2-T2V-A14B", dual_export.original, dual_export.quant, out)
    assert report.removed_stale == [str(staging)]
    assert _staging_dirs(parent) == []
    assert sorted(p.name for p in parent.iterdir()) == ["merged"]
    assert (out / "transformer_2" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("sig", "status", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_sigint_and_sigterm_clean_up(tmp_path, dual_export, sig, status, word):
    parent = tmp_path / "models"
    parent.mkdir()
    out = parent / "merged"
    proc, _ = _start(tmp_path, dual_export, out)
    try:
        assert len(_staging_dirs(parent)) == 1
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status
    assert f"error: {word}; no output was written" in err and "Traceback" not in err
    assert list(parent.iterdir()) == []


def test_only_staging_dirs_of_dead_processes_on_this_host_are_stale(tmp_path):
    from vllm_omni_mxfp4.checkpoint import staging

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(done.stdout)
    host = staging._host()
    target = tmp_path / "out"
    names = {
        "dead": f".out.mxfp4-merge-staging.{host}.{dead_pid}.ab12",
        "dead_replaced": f".out.mxfp4-merge-replaced.{host}.{dead_pid}.cd34",
        "alive": f".out.mxfp4-merge-staging.{host}.{os.getpid()}.ef56",
        "other_host": f".out.mxfp4-merge-staging.elsewhere.{dead_pid}.0000",
        "other_target": f".other.mxfp4-merge-staging.{host}.{dead_pid}.1111",
        "unrelated": f".out.something.{host}.{dead_pid}.2222",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    assert set(staging.remove_stale(target)) == {tmp_path / names["dead"], tmp_path / names["dead_replaced"]}
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names[k] for k in ("alive", "other_host", "other_target", "unrelated")}
