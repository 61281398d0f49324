"""Run a function on real tensor-parallel ranks: one spawned process per rank over gloo.

``run_ranks(world, fn, *args)`` starts ``world`` processes; each sets up vLLM-Omni's diffusion
configs and its (and vLLM's) TP group of size ``world`` over gloo, as the diffusion worker does,
calls ``fn(rank, world, env, *args)`` (``fn`` importable at module level, ``env`` a
:class:`RankEnv`, which the ``vllm_env`` fixture also uses at ``world=1``) and sends its result
back (numpy arrays and plain Python only). The parent waits for every rank's report, never for a fixed time
beyond the generous limit, and fails with the rank's traceback if one raised.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue

import pytest
import torch

from tests.support.ports import free_port

REPORT_TIMEOUT_S = 600


class RankEnv:
    """vLLM-Omni's diffusion configs for a TP group of ``world`` ranks (float32 models), and its
    ``context()``: vLLM's current config and vLLM-Omni's forward context, as the engine sets them."""

    def __init__(self, world: int) -> None:
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

        self.od_config = OmniDiffusionConfig(model=None, dtype=torch.float32, num_gpus=world)
        self.od_config.parallel_config.tensor_parallel_size = world
        self.vllm_config = create_diffusion_vllm_config(torch.device("cpu"), self.od_config)

    @contextlib.contextmanager
    def context(self):
        from vllm.config.vllm import set_current_vllm_config
        from vllm_omni.diffusion.forward_context import set_forward_context

        with (
            set_forward_context(vllm_config=self.vllm_config, omni_diffusion_config=self.od_config),
            set_current_vllm_config(self.vllm_config),
        ):
            yield


def _rank_main(rank: int, world: int, port: int, fn, args, results) -> None:
    try:
        torch.set_num_threads(1)
        from vllm_omni.diffusion.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )

        from vllm_omni_mxfp4.plugin import register

        register()
        env = RankEnv(world)
        with env.context():
            init_distributed_environment(
                world_size=world,
                rank=rank,
                local_rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                backend="gloo",
            )
            initialize_model_parallel(
                tensor_parallel_size=world, data_parallel_size=1, sequence_parallel_size=1, backend="gloo"
            )
        result = fn(rank, world, env, *args)
        destroy_model_parallel()
        destroy_distributed_environment()
        results.put((rank, "ok", result))
    except BaseException:  # report to the parent instead of hanging it
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn, *args) -> dict[int, object]:
    """``fn(rank, world, env, *args)`` on each of ``world`` real TP ranks; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, status, payload = results.get(timeout=REPORT_TIMEOUT_S)
            assert status == "ok", f"rank {rank} failed:\n{payload}"
            got[rank] = payload
    except queue.Empty:
        pytest.fail(f"TP={world} ranks did not report within {REPORT_TIMEOUT_S} s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got
