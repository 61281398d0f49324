"""``vllm serve <tiny Wan2.2> --omni`` on the CPU platform: one text-to-video request over HTTP.

Uses vLLM-Omni's OpenAI-style video API: ``POST /v1/videos`` (multipart form) creates a job,
``GET /v1/videos/{id}`` reports its status, ``GET /v1/videos/{id}/content`` returns the MP4.
The server runs in its own process group; every wait has a deadline, and the group is reaped in
``finally`` (SIGTERM, then SIGKILL), so no worker outlives the test.
"""

from __future__ import annotations

import io
import subprocess
import time
from pathlib import Path

import numpy as np
from omni_procs import SERVER_MARKS, log_tail, reap_group, serve_command, subprocess_env, wait_until_healthy

from tests.support.ports import free_port

pytestmark = SERVER_MARKS

STARTUP_DEADLINE_S = 300.0
JOB_DEADLINE_S = 120.0
HTTP_TIMEOUT_S = 10.0


def _decode_mp4(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_serve_text_to_video_round_trip(tiny_dir: Path, tmp_path: Path) -> None:
    import requests

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    command = serve_command(tiny_dir, port)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True
        )
    leftover: list[int] = []
    try:
        wait_until_healthy(base, server, log, STARTUP_DEADLINE_S)

        form = {
            "prompt": "a cat walking on the grass",
            "negative_prompt": "blurry low quality",
            "width": "16",
            "height": "16",
            "num_frames": "9",
            "num_inference_steps": "2",
            "guidance_scale": "5.0",
            "seed": "0",
        }
        created = requests.post(
            f"{base}/v1/videos", files={k: (None, v) for k, v in form.items()}, timeout=30
        )
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress", "completed")

        deadline = time.monotonic() + JOB_DEADLINE_S
        while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = requests.get(f"{base}/v1/videos/{job['id']}", timeout=HTTP_TIMEOUT_S).json()
        assert job["status"] == "completed", f"job not completed: {job}\n{log_tail(log)}"
        assert job["error"] is None and job["num_frames"] == 9

        content = requests.get(f"{base}/v1/videos/{job['id']}/content", timeout=30)
        assert content.status_code == 200
        assert content.headers["content-type"].startswith("video/mp4")
        frames = _decode_mp4(content.content)
        assert frames.shape == (9, 16, 16, 3)
        assert frames.std() > 1.0  # a picture, not a flat colour
    finally:
        leftover = reap_group(server, settle=30.0)
    assert server.returncode is not None
    assert not leftover, f"server processes {leftover} outlived SIGTERM by 30s"
