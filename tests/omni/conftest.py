"""Fixtures for tests that build vLLM / vLLM-Omni layers in this process (TP=1, gloo, CPU)."""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch

pytest.importorskip("vllm_omni")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmEnv:
    """vLLM-Omni diffusion configs plus an initialized TP=1 process group."""

    def __init__(self) -> None:
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

        self.od_config = OmniDiffusionConfig(model=None, dtype=torch.float32, num_gpus=1)
        self.vllm_config = create_diffusion_vllm_config(torch.device("cpu"), self.od_config)

    @contextlib.contextmanager
    def context(self):
        """vLLM's current config and vLLM-Omni's forward context, as the engine sets them."""
        from vllm.config.vllm import set_current_vllm_config
        from vllm_omni.diffusion.forward_context import set_forward_context

        with (
            set_forward_context(vllm_config=self.vllm_config, omni_diffusion_config=self.od_config),
            set_current_vllm_config(self.vllm_config),
        ):
            yield


@pytest.fixture(scope="session")
def vllm_env():
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from vllm_omni_mxfp4.omni.plugin import register

    register()
    env = VllmEnv()
    with env.context():
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(
            tensor_parallel_size=1, data_parallel_size=1, sequence_parallel_size=1, backend="gloo"
        )
    yield env
    destroy_model_parallel()
    destroy_distributed_environment()
