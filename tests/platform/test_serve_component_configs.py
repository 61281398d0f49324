"""``vllm serve --omni --diffusion-quantization-config``: the user guide's per-component forms, and
names that match nothing, on the tiny two-expert Wan2.2 (2 blocks per expert) on the CPU platform.

The per-component dicts whose values are all method names (``{"transformer": "mxfp4"}``,
``{"default": "mxfp4"}``) serve a request with exactly the experts they name quantized (the trace
file tells the quantized Linears apart). A component key, a layer entry or a leading-block count
that matches nothing in the built model stops the server at start-up with the message naming it.
Every server runs in its own process group, bounded, and is reaped (the demo's runner).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omni_procs import (
    SERVER_MARKS,
    RunFailed,
    log_tail,
    reap_group,
    run_bounded,
    serve_command,
    subprocess_env,
    video_job,
    wait_until_healthy,
)

from tests.support.ports import free_port

pytestmark = SERVER_MARKS

STARTUP_DEADLINE_S = 300.0
JOB_DEADLINE_S = 180.0
HTTP_TIMEOUT_S = 10.0


def _serve_args(model: Path, port: int, config: dict) -> list[str]:
    """``vllm serve --omni`` arguments (without the interpreter) with a per-component config."""
    return [*serve_command(model, port)[1:], "--diffusion-quantization-config", json.dumps(config)]


def _one_video(base: str, log: Path) -> dict:
    form = {"prompt": "a cat", "width": "16", "height": "16", "num_frames": "9", "num_inference_steps": "2"}
    return video_job(base, form, log, JOB_DEADLINE_S)


@pytest.mark.parametrize(
    ("config", "quantized"),
    [({"transformer": "mxfp4"}, 16), ({"default": "mxfp4"}, 32)],
    ids=["transformer-only", "default"],
)
def test_per_component_method_names_serve(tiny_dir: Path, tmp_path: Path, config, quantized) -> None:
    port, log, trace = free_port(), tmp_path / "server.log", tmp_path / "trace.jsonl"
    env = subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)})
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, *_serve_args(tiny_dir, port, config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, log, STARTUP_DEADLINE_S)
        assert _one_video(f"http://127.0.0.1:{port}", log)["error"] is None
    finally:
        leftover = reap_group(server, settle=30.0)
    assert not leftover, f"server processes {leftover} outlived SIGTERM by 30s"
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {c["method"] for c in calls} == {"mxfp4"}
    # 16 Linears per expert: one expert quantized (transformer_2 has no entry and no default) or both.
    assert len({(c["pid"], c["layer"]) for c in calls}) == quantized


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"transfomer": "mxfp4", "transformer_2": "mxfp4"},
            "Unknown component 'transfomer' in the per-component config. Did you mean 'transformer'?",
        ),
        (
            {"method": "mxfp4", "ignored_layers": ["blocks.1.ffn.net2"]},
            "ignored_layers entry 'blocks.1.ffn.net2' matches no Linear of the WanTransformer3DModel",
        ),
        (
            # The user guide's form is accepted; mxfp4_dualscale's default keeps 5 blocks of 2 in BF16.
            {"transformer": "mxfp4", "transformer_2": "mxfp4_dualscale"},
            "num_bf16_fallback_layers=5 is larger than the 2 blocks",
        ),
    ],
    ids=["component-typo", "layer-typo", "leading-blocks"],
)
def test_names_that_match_nothing_stop_the_server(tiny_dir: Path, tmp_path: Path, config, message) -> None:
    log = tmp_path / "server.log"
    with pytest.raises(RunFailed) as info:
        run_bounded(
            _serve_args(tiny_dir, free_port(), config),
            timeout=STARTUP_DEADLINE_S,
            env=subprocess_env(),
            log=log,
        )
    assert info.value.reason.startswith("exited with"), info.value
    assert message in log.read_text(), log_tail(log)
