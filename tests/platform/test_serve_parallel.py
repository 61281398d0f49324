"""``vllm serve --omni`` with the MXFP4 guide's four ranks (``--ulysses-degree 2 --cfg-parallel-size 2``)
on the CPU platform: quantized requests, concurrent and sequential, the same videos as one rank, and
no rank process left after a signal.

Two servers of the tiny two-expert Wan2.2 with the online method bundle of
:mod:`tests.support.bundles` (``mxfp4`` with W4A8 by layer and on step 0 for ``transformer``,
``mxfp4_dualscale`` for ``transformer_2``, through ``--diffusion-quantization-config``: the step
index must stay right for requests in flight together), each in its own process group:

- four ranks (``VLLM_OMNI_MXFP4_CPU_DEVICES=4`` on a two-core machine): two requests one after the
  other, then the same two at once; then SIGINT (Ctrl-C) to the server process alone;
- one rank: the first request; then SIGTERM (what service managers send) to the server process alone.

The videos of concurrent requests equal those of sequential ones, and the four-rank videos equal the
one-rank video (decoded MP4 frames, bit for bit: the frames are equal, ``tests/omni/test_parallel.py``,
and the server encodes equal frames the same way). After the signal every process of the server's
group (API server, engine, stage and the rank workers) must exit by itself within
:data:`SHUTDOWN_DEADLINE_S`; the trace shows that four rank processes ran quantized Linears.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from omni_procs import (
    SERVER_MARKS,
    create_video,
    reap_group,
    serve_command,
    subprocess_env,
    wait_until_healthy,
    wait_video,
)

from tests.support.bundles import STORED, bundle, require_bundle
from tests.support.ports import free_port
from vllm_omni_mxfp4_tiny.runner import group_members

pytestmark = SERVER_MARKS

STARTUP_DEADLINE_S = 420.0
JOB_DEADLINE_S = 240.0
SHUTDOWN_DEADLINE_S = 60.0
FOUR_RANKS = ["--ulysses-degree", "2", "--cfg-parallel-size", "2"]
SEEDS = (1, 2)


def _form(seed: int) -> dict[str, str]:
    return {
        "prompt": "a cat walking on the grass", "negative_prompt": "blurry low quality", "width": "32",
        "height": "32", "num_frames": "5", "num_inference_steps": "3", "guidance_scale": "4.0",
        "seed": str(seed),
    }  # fmt: skip


def _frames(base: str, job: dict) -> np.ndarray:
    import av
    import requests

    content = requests.get(f"{base}/v1/videos/{job['id']}/content", timeout=30)
    assert content.status_code == 200 and content.headers["content-type"].startswith("video/mp4")
    with av.open(io.BytesIO(content.content)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _serve(
    model: Path, config: dict, work: Path, layout: list[str], devices: int, requests_of, stop: signal.Signals
) -> dict:
    """Start a server, run ``requests_of(base, log)``, send ``stop`` to the server process alone and
    wait for its group to empty; what the requests returned, the processes left, the trace's pids."""
    port, log, trace = free_port(), work / "server.log", work / "trace.jsonl"
    env = subprocess_env(
        {"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace), "VLLM_OMNI_MXFP4_CPU_DEVICES": str(devices)}
    )
    flags = ["--diffusion-quantization-config", json.dumps(config)] if config else []  # none: as stored
    command = [*serve_command(model, port), *flags, *layout]
    with open(log, "wb") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    left: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, server, log, STARTUP_DEADLINE_S)
        videos = requests_of(base, log)
        server.send_signal(stop)
        deadline = time.monotonic() + SHUTDOWN_DEADLINE_S
        while (left := group_members(server.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        reap_group(server, settle=1.0)  # whatever the signal left, so that no test leaks it
    pids = {json.loads(line)["pid"] for line in trace.read_text().splitlines()} if trace.exists() else set()
    return {"videos": videos, "left": left, "rank_pids": pids, "returncode": server.returncode}


def _sequential_then_concurrent(base: str, log: Path) -> dict:
    videos = {
        ("sequential", s): _frames(base, wait_video(base, create_video(base, _form(s)), log, JOB_DEADLINE_S))
        for s in SEEDS
    }
    jobs = {s: create_video(base, _form(s)) for s in SEEDS}  # both queued before either is polled
    videos.update(
        {("concurrent", s): _frames(base, wait_video(base, j, log, JOB_DEADLINE_S)) for s, j in jobs.items()}
    )
    return videos


def _first_request(base: str, log: Path) -> dict:
    return {
        ("sequential", SEEDS[0]): _frames(
            base, wait_video(base, create_video(base, _form(SEEDS[0])), log, JOB_DEADLINE_S)
        )
    }


@pytest.fixture(scope="module")
def servers(tiny_dir: Path, tmp_path_factory) -> dict[str, dict]:
    model, kwargs = bundle("online", tiny_dir, tmp_path_factory.mktemp("model"), [0])
    config = kwargs["quantization_config"]
    four = _serve(
        model,
        config,
        tmp_path_factory.mktemp("four"),
        FOUR_RANKS,
        4,
        _sequential_then_concurrent,
        signal.SIGINT,
    )
    one = _serve(model, config, tmp_path_factory.mktemp("one"), [], 2, _first_request, signal.SIGTERM)
    return {"four": four, "one": one}


def test_four_ranks_serve_quantized_requests(servers):
    four = servers["four"]
    assert len(four["rank_pids"]) == 4  # every rank process ran the quantized Linears
    for video in four["videos"].values():
        assert video.shape == (5, 32, 32, 3) and video.std() > 1.0


def test_concurrent_requests_equal_sequential_ones(servers):
    videos = servers["four"]["videos"]
    for seed in SEEDS:
        assert np.array_equal(videos["concurrent", seed], videos["sequential", seed])
    assert not np.array_equal(videos["sequential", SEEDS[0]], videos["sequential", SEEDS[1]])


def test_four_ranks_serve_the_one_rank_video(servers):
    key = ("sequential", SEEDS[0])
    assert np.array_equal(servers["four"]["videos"][key], servers["one"]["videos"][key])


@pytest.mark.parametrize(("server", "sent"), [("four", "SIGINT"), ("one", "SIGTERM")])
def test_a_signal_to_the_server_leaves_no_process_behind(servers, server, sent):
    assert servers[server]["left"] == [], f"{sent} to the server left processes {servers[server]['left']}"


@pytest.mark.parametrize("name", STORED)
def test_the_stored_engines_serve_with_four_ranks(request, tiny_dir: Path, tmp_path: Path, name: str):
    """With ``--all-bundles``: the offline checkpoint and the NVFP4 engine behind the four-rank server,
    two requests one after the other and then at once (the same videos), then SIGTERM to the server
    process alone (its group empties by itself)."""
    require_bundle(request.config, name)
    model, kwargs = bundle(name, tiny_dir, tmp_path / "model", [0])
    config = kwargs.get("quantization_config", {})  # the checkpoint's own config.json: no flag
    served = _serve(model, config, tmp_path, FOUR_RANKS, 4, _sequential_then_concurrent, signal.SIGTERM)
    assert len(served["rank_pids"]) == 4 and served["left"] == []
    for seed in SEEDS:
        assert np.array_equal(served["videos"]["concurrent", seed], served["videos"]["sequential", seed])
