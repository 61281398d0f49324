"""Fixtures of the CPU platform tests: a test-only plugin site (the tiny Wan2.2 is ``tiny_dir``, tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

CPU_TEST_QUANT_ENTRY_POINT = "cpu_test_quant"


@pytest.fixture(scope="session")
def cpu_test_quant_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sys.path entry whose dist-info declares ``cpu_test_quant:register`` as a general plugin.

    ``importlib.metadata`` finds entry points in any dist-info on ``sys.path``, exactly as for an
    installed package, so this is how a separately installed quantization plugin is seen.
    """
    site = tmp_path_factory.mktemp("cpu_test_quant_site")
    dist_info = site / "cpu_test_quant_plugin-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: cpu-test-quant-plugin\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[vllm_omni.general_plugins]\n{CPU_TEST_QUANT_ENTRY_POINT} = cpu_test_quant:register\n"
    )
    return site
