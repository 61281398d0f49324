"""Fixtures shared by every test directory.

``tiny_dir``: the demo's tiny two-expert Wan2.2 pipeline (built once into the tiny-model cache).
``shared_runs``: engine runs that several files compare against, run once per test run
(:mod:`tests.support.engine_runs`).

``vllm_env``: vLLM-Omni's diffusion configs plus an initialized TP=1 gloo process group in this
process, as the diffusion worker sets them up, for tests that build vLLM / vLLM-Omni layers here.
It is module-scoped: the process group is torn down after each module, because other code that
runs in the same pytest process (msModelSlim's quantizers) changes behaviour when
``torch.distributed`` is initialized.

``caplog`` also sees records that end at vLLM's logger: once vLLM has configured logging, the
package's logger (and vLLM-Omni's) is a child of ``vllm``, which does not propagate to the root
logger where pytest's handler sits (autouse, for tests that ask for ``caplog``).

Autouse checks after each test or module: Python dispatch is still on in the thread
(``_python_dispatch_stays_on``) and ``torch.distributed`` is torn down (module-scoped).

Under pytest-xdist (``scripts/test.sh``), every test is put in a group of tests that share what is
expensive to build, and the longest groups start first: :mod:`tests.support.scheduling`.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from tests.support.ports import free_port
from tests.support.scheduling import assign_groups
from tests.support.tp_ranks import RankEnv


@pytest.fixture(autouse=True)
def _caplog_sees_vllm_children(request: pytest.FixtureRequest):
    if "caplog" not in request.fixturenames:
        yield
        return
    handler = request.getfixturevalue("caplog").handler
    vllm_root = logging.getLogger("vllm")
    vllm_root.addHandler(handler)
    try:
        yield
    finally:
        vllm_root.removeHandler(handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-models",
        action="store_true",
        default=False,
        help="write the tiny models' measurements to docs/models_measured.json instead of checking "
        "them (tests/models/conftest.py)",
    )
    parser.addoption(
        "--all-bundles",
        action="store_true",
        default=False,
        help="run the deployment tests (parallelism, cache, LoRA, compile) with the stored-method engines "
        "too (offline checkpoint, NVFP4; tests/support/bundles.py): about 8 more minutes on two cores",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    assign_groups(config, items)


@pytest.fixture(scope="session")
def tiny_dir():
    """The tiny two-expert Wan2.2 pipeline (2 blocks per expert) from the default cache."""
    from vllm_omni_mxfp4_tiny import build_tiny_wan

    return build_tiny_wan(2)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    from tests.support.engine_runs import SharedRuns, run_root  # the demo's engine job

    return SharedRuns(run_root(tmp_path_factory) / "shared-engine-runs")


@pytest.fixture(scope="module")
def vllm_env():
    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip("vllm / vllm-omni not installed")
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from vllm_omni_mxfp4.plugin import register

    register()
    env = RankEnv(world=1)
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


_PYTHON_DISPATCH = torch._C.DispatchKey.Python


@pytest.fixture(autouse=True)
def _python_dispatch_stays_on(request: pytest.FixtureRequest):
    """Fail the test that leaves Python dispatch switched off in this thread, and switch it back on.

    A ``no_dispatch()`` guard held by a suspended generator (or RAII guards freed out of order by
    the garbage collector) leaves the Python dispatch key excluded after its test ends. Every later
    test in the worker then runs without dispatch modes: the loader's copy counter refuses to load
    and ``torch.compile`` refuses to trace, far from the test that caused it."""
    yield
    if torch._C._dispatch_tls_is_dispatch_key_excluded(_PYTHON_DISPATCH):
        torch._C._dispatch_tls_set_dispatch_key_excluded(_PYTHON_DISPATCH, False)
        torch._C._dispatch_tls_set_dispatch_key_excluded(torch._C.DispatchKey.PythonTLSSnapshot, False)
        pytest.fail(f"{request.node.nodeid} left Python dispatch switched off in this thread", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_leaks_into_other_modules():
    """Fail loudly if a module leaves torch.distributed initialized for the next one."""
    yield
    if torch.distributed.is_available():
        assert not torch.distributed.is_initialized(), "a test module left torch.distributed initialized"
