"""Interruptions: a merge stopped midway leaves no output and no staging directory; a SIGKILL's
leftover is found by the next merge to any target (removed) and by ``--dry-run`` (reported).

Nothing here waits a fixed time: the child merge writes a marker file when it reaches the slowed
write (and, for the double Ctrl-C, when it is cleaning up), the test waits for that condition, and
every wait has a generous deadline that only a hung child reaches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_omni_mxfp4.checkpoint import merge
from vllm_omni_mxfp4.publish import staging

# The real CLI with the 40th tensor write held until a signal arrives. With ``hold_cleanup`` the
# staging directory's removal also waits (after writing the "cleaning" marker) until the test
# creates the "go" file, so that a second signal lands in the middle of the cleanup.
_SLOW_MERGE = """
import sys, time, pathlib
from vllm_omni_mxfp4 import safetensors_io
from vllm_omni_mxfp4.publish import staging
marker, hold_cleanup = pathlib.Path(sys.argv[1]), sys.argv[2] == "1"
real_write, real_discard = safetensors_io.CopyBytes.write_to, staging.discard
calls = []
def slow(self, out, progress):
    calls.append(1)
    if len(calls) == 40:
        marker.write_text("midway")
        while True:
            time.sleep(3600)
    return real_write(self, out, progress)
def held_discard(path):
    (marker.parent / "cleaning").write_text("cleaning")
    while not (marker.parent / "go").exists():
        time.sleep(0.01)
    real_discard(path)
safetensors_io.CopyBytes.write_to = slow
if hold_cleanup:
    staging.discard = held_discard
from vllm_omni_mxfp4.cli import main
sys.exit(main(sys.argv[3:]))
"""
_DEADLINE_S = 600  # only a hung child reaches it; a loaded machine takes seconds
_HANDLED = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM)


def _default_signals() -> None:
    """In the child: the default disposition of the handled signals, whatever the suite inherited
    (a background job starts with SIGINT ignored, nohup with SIGHUP ignored)."""
    for signum in _HANDLED:
        signal.signal(signum, signal.SIG_DFL)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the merge did not reach {path.name}: status {proc.returncode}, {err[-2000:]}")
        time.sleep(0.02)


def _start(
    tmp_path: Path, scenario, out: Path, hold_cleanup: bool = False, preexec=_default_signals
) -> subprocess.Popen:
    marker = tmp_path / "midway"
    argv = ["merge", "--model-type", "Wan2.2-T2V-A14B", "--original-model", str(scenario.original)]
    argv += ["--quant-path", str(scenario.quant), "--output-path", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_MERGE, str(marker), "1" if hold_cleanup else "0", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
        env={**os.environ},  # HOME is the session's temporary home (conftest), so is the registry
    )
    _wait_for(marker, proc)
    return proc


def _finish(proc: subprocess.Popen) -> str:
    try:
        _, err = proc.communicate(timeout=_DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return err


def _staging_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if ".mxfp4-merge-" in p.name)


def _registry() -> list[Path]:
    folder = staging.registry_dir()
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _killed_merge(tmp_path: Path, scenario) -> tuple[Path, Path]:
    """A merge SIGKILLed midway: its parent directory and the staging directory it leaves."""
    parent = tmp_path / "models"
    parent.mkdir()
    proc = _start(tmp_path, scenario, parent / "merged")
    try:
        (stage,) = _staging_dirs(parent)
        assert stage.name.startswith(".merged.mxfp4-merge-staging.") and stage.name.split(".")[-2] == str(
            proc.pid
        )
        owner = json.loads((stage / staging.OWNER_FILE).read_text())
        assert owner["pid"] == proc.pid and owner["start"] == staging.process_start(proc.pid)
        assert (stage / "transformer").is_dir()  # midway: files are being written
        proc.send_signal(signal.SIGKILL)
    finally:
        _finish(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (parent / "merged").exists()
    assert _staging_dirs(parent) == [stage]  # only the recognisable staging directory is left
    assert len(_registry()) == 1
    return parent, stage


def test_sigkill_leftover_is_reported_by_dry_run_and_removed_by_a_merge_to_another_target(
    tmp_path, dual_export
):
    parent, stage = _killed_merge(tmp_path, dual_export)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = elsewhere / "other"

    dry = merge("Wan2.2-T2V-A14B", dual_export.original, dual_export.quant, other, dry_run=True)
    assert dry.stale_staging == [str(stage)] and dry.removed_stale == []
    assert _staging_dirs(parent) == [stage]  # a dry run writes nothing, not even a removal

    report = merge("Wan2.2-T2V-A14B", dual_export.original, dual_export.quant, other)
    assert report.removed_stale == [str(stage)]
    assert list(parent.iterdir()) == [] and _registry() == []
    assert (other / "transformer_2" / "diffusion_pytorch_model.safetensors").is_file()


def test_cli_dry_run_reports_the_leftover(tmp_path, dual_export, capsys):
    from vllm_omni_mxfp4.cli import main

    parent, stage = _killed_merge(tmp_path, dual_export)
    argv = ["merge", "--model-type", "auto", "--original-model", str(dual_export.original)]
    argv += ["--quant-path", str(dual_export.quant), "--output-path", str(tmp_path / "x"), "--dry-run"]
    assert main(argv) == 0
    assert f"stale: {stage}, left by a killed merge" in capsys.readouterr().out
    assert _staging_dirs(parent) == [stage]


@pytest.mark.parametrize("sig", _HANDLED, ids=lambda s: signal.Signals(s).name)
def test_each_handled_signal_cleans_up(tmp_path, dual_export, sig):
    parent = tmp_path / "models"
    parent.mkdir()
    proc = _start(tmp_path, dual_export, parent / "merged")
    assert len(_staging_dirs(parent)) == 1 and len(_registry()) == 1
    proc.send_signal(sig)
    err = _finish(proc)
    assert proc.returncode == 128 + sig, err
    assert f"({signal.Signals(sig).name}); no output was written" in err and "Traceback" not in err
    assert list(parent.iterdir()) == [] and _registry() == []


def test_a_second_ctrl_c_during_the_cleanup_does_not_stop_it(tmp_path, dual_export):
    parent = tmp_path / "models"
    parent.mkdir()
    proc = _start(tmp_path, dual_export, parent / "merged", hold_cleanup=True)
    try:
        proc.send_signal(signal.SIGINT)
        _wait_for(tmp_path / "cleaning", proc)
        proc.send_signal(signal.SIGINT)  # lands while the staging directory is being removed
        proc.send_signal(signal.SIGTERM)
    finally:
        (tmp_path / "go").write_text("go")
    err = _finish(proc)
    assert proc.returncode == 130, err
    assert "error: interrupted (SIGINT); no output was written" in err and "Traceback" not in err
    assert list(parent.iterdir()) == [] and _registry() == []


def _nohup() -> None:
    _default_signals()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_a_signal_the_parent_ignores_stays_ignored(tmp_path, dual_export):
    """Under ``nohup`` a hang-up does not stop the merge; a later SIGTERM still cleans up."""
    parent = tmp_path / "models"
    parent.mkdir()
    proc = _start(tmp_path, dual_export, parent / "merged", preexec=_nohup)
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGTERM)  # SIGHUP is ignored: this is the one the merge reports
    err = _finish(proc)
    assert proc.returncode == 143, err
    assert "error: terminated (SIGTERM); no output was written" in err
    assert list(parent.iterdir()) == [] and _registry() == []


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_only_staging_dirs_of_processes_that_are_gone_are_stale(tmp_path):
    dead, host = _dead_pid(), staging._host()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        start = staging.process_start(live.pid)
        target = tmp_path / "out"
        names = {
            "dead": (f".out.mxfp4-merge-staging.{host}.{dead}.ab12", None),
            "dead_replaced": (f".out.mxfp4-merge-replaced.{host}.{dead}.cd34", None),
            "other_target": (f".other.mxfp4-merge-staging.{host}.{dead}.1111", None),
            "pid_reused": (f".out.mxfp4-merge-staging.{host}.{live.pid}.aa", {"start": "1"}),
            "alive": (f".out.mxfp4-merge-staging.{host}.{live.pid}.ef56", {"start": start}),
            "alive_no_owner_file": (f".out.mxfp4-merge-staging.{host}.{os.getpid()}.ef57", None),
            "other_host": (f".out.mxfp4-merge-staging.elsewhere.{dead}.0000", None),
            "unrelated": (f".out.something.{host}.{dead}.2222", None),
        }
        for name, owner in names.values():
            (tmp_path / name).mkdir()
            if owner is not None:
                record = {"host": host, "pid": int(name.split(".")[-2]), **owner}
                (tmp_path / name / staging.OWNER_FILE).write_text(json.dumps(record))
        removed = staging.remove_stale(target)
    finally:
        live.kill()
        live.wait()
    gone = ("dead", "dead_replaced", "other_target", "pid_reused")
    assert set(removed) == {tmp_path / names[k][0] for k in gone}
    assert {p.name for p in tmp_path.iterdir()} == {n for k, (n, _) in names.items() if k not in gone}


def test_registry_entries_are_pruned_only_when_their_owner_is_gone(tmp_path):
    host, registry = staging._host(), staging.registry_dir()
    registry.mkdir(parents=True)
    entries = {}
    for key, pid in (("dead", _dead_pid()), ("being_created", os.getpid())):
        path = tmp_path / "elsewhere" / f".out.mxfp4-merge-staging.{host}.{pid}.{key.encode().hex()}"
        entries[key] = registry / f"{path.name[1:]}.json"
        entries[key].write_text(json.dumps({"host": host, "pid": pid, "start": None, "path": str(path)}))
    assert staging.remove_stale(tmp_path / "out") == []
    assert not entries["dead"].exists() and entries["being_created"].exists()
