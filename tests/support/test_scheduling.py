"""The suite's own plumbing under pytest-xdist: how tests are grouped and ordered, and free ports."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tests.support import ports, scheduling


@dataclass(frozen=True)
class _Item:
    """What the grouping reads of a pytest item."""

    nodeid: str
    callspec: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(params={}), compare=False)

    @property
    def name(self) -> str:
        return self.nodeid.rsplit("::", 1)[-1]

    @property
    def originalname(self) -> str:
        return self.name.split("[", 1)[0]


def _doc_session(name: str, code: str) -> SimpleNamespace:
    """What the grouping reads of a doc session (tests/docs/doc_blocks.py's Session)."""
    return SimpleNamespace(name=name, steps=[SimpleNamespace(block=SimpleNamespace(code=code))])


def test_a_file_a_shared_directory_or_a_doc_session_is_a_group():
    groups = {
        "tests/omni/test_wan_tp2.py::test_tp2_equals_tp1[ocp]": "tests/omni/test_wan_tp2.py",
        "tests/omni/test_wan_tp2.py::test_dualscale_with_unaligned_row_shards_equals_tp1[4]": (
            "tests/omni/test_wan_tp2.py"
        ),
        "tests/checkpoint/test_recipes.py::test_x": "tests/checkpoint/",
        "tests/checkpoint/test_merge.py::test_y[a]": "tests/checkpoint/",
        "tests/models/test_online_models.py::test_z": "tests/models/",
        "tests/docs/test_doc_blocks.py::test_docs_run_something": "tests/docs/test_doc_blocks.py",
    }
    assert {nodeid: scheduling.group_of(_Item(nodeid)) for nodeid in groups} == groups


def test_a_doc_session_is_named_after_what_it_runs_not_its_line():
    runs = "tests/docs/test_doc_blocks.py::test_doc_session_runs"
    bench = _Item(f"{runs}[README.md:269]", SimpleNamespace(params={"session": _doc_session(
        "README.md:269", "\n  python bench/requant.py --load [x]\nmore\n"
    )}))  # fmt: skip
    named = _Item(f"{runs}[README.md#merge]", SimpleNamespace(params={"session": _doc_session(
        "README.md#merge", "python - <<'EOF'\n"
    )}))  # fmt: skip
    assert scheduling.group_of(bench) == "doc:python bench/requant.py --load (x)"
    assert scheduling.group_of(named) == "doc:README.md#merge"
    # xdist takes the group after the node id's last "@", past its last "]"
    assert scheduling._safe("a@b[c]") == "a_b(c)"


def test_the_longest_groups_come_first_and_a_group_keeps_its_order():
    nodeids = [
        "tests/formats/test_mx.py::test_a",
        "tests/docs/test_doc_blocks.py::test_docs_run_something",
        "tests/omni/test_wan_tp2.py::test_b",
        "tests/formats/test_mx.py::test_c",
        "tests/demo/test_models_e2e.py::test_d",
        "tests/omni/test_wan_tp2.py::test_e",
    ]
    items = [_Item(n) for n in nodeids]
    groups = {item: scheduling.group_of(item) for item in items}
    ordered = [item.nodeid for item in scheduling.longest_first(items, groups)]
    assert ordered == [
        "tests/demo/test_models_e2e.py::test_d",
        "tests/omni/test_wan_tp2.py::test_b",
        "tests/omni/test_wan_tp2.py::test_e",
        "tests/docs/test_doc_blocks.py::test_docs_run_something",
        "tests/formats/test_mx.py::test_a",  # not listed: collection order, after the listed
        "tests/formats/test_mx.py::test_c",
    ]


def test_ports_are_free_distinct_and_in_a_block_of_their_own_per_worker(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    start = ports.FIRST_PORT + ports.BLOCK
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20 and all(start <= p < start + ports.BLOCK for p in got)
    assert max(got) < 32768  # below the kernel's ephemeral range
    for port in got:  # free when handed out (nothing here bound them since)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert ports.worker_index() == 0 and ports.FIRST_PORT <= ports.free_port() < start


def test_a_port_in_use_is_skipped(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    start = ports.FIRST_PORT + 2 * ports.BLOCK
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", start))
        except OSError:
            pytest.skip(f"port {start} is taken on this machine")
        busy.listen()
        monkeypatch.setattr(ports.random, "randrange", lambda n: 0)  # start the search at the busy port
        assert ports.free_port() == start + ports.STRIDE


def test_a_real_xdist_run_keeps_each_group_in_one_worker(tmp_path):
    """Under ``-n 2 --dist loadgroup`` the workers' node ids carry the groups, and every test of a
    file runs in the worker that runs the rest of it (xdist's default would spread them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts =\n")
    (tmp_path / "conftest.py").write_text(
        "import pytest\nfrom tests.support.scheduling import assign_groups\n\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_collection_modifyitems(config, items):\n    assign_groups(config, items)\n"
    )
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, pytest\n\n@pytest.mark.parametrize('i', range(8))\n"
            f"def test_{name}(i):\n"
            f"    with open({str(tmp_path / name)!r}, 'a') as f:\n"
            "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
            ".",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_a.py::test_a[0]@test_a.py" in run.stdout, run.stdout
    for name in ("a", "b"):
        workers = set((tmp_path / name).read_text().split())
        assert len(workers) == 1, (name, workers, run.stdout)
