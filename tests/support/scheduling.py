"""How the suite is spread over pytest-xdist workers (``scripts/test.sh``: ``-n 2 --dist loadgroup``).

Under ``--dist loadgroup`` xdist hands each worker whole groups of tests (``xdist_group`` marks).
:func:`group_of` puts every test in a group, so that what tests share stays in one process:

- a test file is a group (its module-scoped engines, references and process groups are built once);
- a directory of :data:`SHARED_DIRS` is one group: its files share session fixtures or caches that
  are expensive to build twice (msModelSlim exports, the scan of every vLLM-Omni model file);
- each doc session (``tests/docs/test_doc_blocks.py::test_doc_session_runs``) is a group of its own:
  the sessions are independent commands, and some of them take minutes. The group is named after
  what the session runs (``doc:`` and its first command line, or ``doc:README.md#merge`` for a
  named session), which does not move when lines are added above it; the rest of the file is one
  group.

:func:`longest_first` then orders the groups: those of :data:`LONGEST` first, in that order (the
longest units of a ``--durations`` run), the others after them in collection order, so that no
long unit starts last while the other worker idles. The order changes only how evenly the workers
finish, never what a test sees: a stale list costs time, not correctness.
"""

from __future__ import annotations

import pytest

SHARED_DIRS = ("tests/checkpoint/", "tests/models/")
DOC_SESSIONS = ("tests/docs/test_doc_blocks.py", "test_doc_session_runs")
#: Group-name prefixes, longest units first (from --durations runs on the 2-core machine).
LONGEST = (
    "tests/omni/test_parallel.py",
    "tests/demo/test_models_e2e.py",
    "tests/tune/test_tune_e2e.py",
    "tests/demo/test_tune_families.py",
    "tests/omni/test_compile.py",
    "tests/platform/test_serve_parallel.py",
    "tests/omni/test_lora.py",
    "tests/omni/test_cache.py",
    "tests/checkpoint/",
    "tests/models/",
    "tests/platform/test_serve_component_configs.py",
    "tests/omni/test_wan_tp2.py",
    "tests/platform/test_omni_engine.py",
    "tests/omni/test_omni_e2e.py",  # before the other users of the shared BF16 run
    "tests/omni/test_tensor_parallel.py",
    "tests/demo/test_demo_e2e.py",
    "tests/hooks/test_nvfp4_e2e.py",
    "tests/hooks/test_upstream_checkpoints.py",
    "tests/demo/test_runner.py",
    "doc:python bench/requant.py --load",
    "tests/hooks/test_omni_names_e2e.py",
    "doc:python bench/linear.py",
    "doc:README.md#merge",
    "doc:docs/user_guide.md#validate",
    "tests/examples/test_text_to_video.py",
    "doc:docs/user_guide.md#w4a8-serve",
    "tests/hooks/test_nvfp4_models.py",
    "doc:README.md#serve",
    "tests/hooks/test_nvfp4_tp2.py",
    "doc:python examples/offline_inference/text_to_video/text_to_video.py",
    "doc:import json",  # docs/user_guide.md's W4A8 Omni(...) example
    "doc:from vllm_omni import Omni",  # README's Omni(...) example
    "tests/convert/test_convert_e2e.py",
    "tests/docs/test_doc_blocks.py",
)


def _safe(name: str) -> str:
    """xdist finds the group after the last ``@`` of a node id, past its last ``]``."""
    return name.replace("[", "(").replace("]", ")").replace("@", "_")


def doc_session_group(session) -> str:
    """``doc:`` and a named session's name, or the first line of a session's first block."""
    if "#" in session.name:
        return f"doc:{session.name}"
    first = next((line.strip() for line in session.steps[0].block.code.splitlines() if line.strip()), "")
    return _safe(f"doc:{first}")


def group_of(item: pytest.Item) -> str:
    """The ``xdist_group`` of ``item`` (see the module)."""
    path = item.nodeid.split("::", 1)[0]
    for directory in SHARED_DIRS:
        if path.startswith(directory):
            return directory
    if (path, getattr(item, "originalname", item.name)) == DOC_SESSIONS:
        return doc_session_group(item.callspec.params["session"])
    return path


def _rank(group: str) -> int:
    return next((i for i, prefix in enumerate(LONGEST) if group.startswith(prefix)), len(LONGEST))


def longest_first(items: list[pytest.Item], groups: dict[pytest.Item, str]) -> list[pytest.Item]:
    """``items`` with the groups of :data:`LONGEST` first; a group's tests stay in their order."""
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(groups[item], index)
    return sorted(items, key=lambda item: (_rank(groups[item]), first_seen[groups[item]]))


def assign_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every item with its group and order them (only in an xdist worker under loadgroup)."""
    # In a worker xdist sets the option dist to "no" and records --dist loadgroup as the option loadgroup.
    if not hasattr(config, "workerinput") or not config.getoption("loadgroup", False):
        return
    groups = {item: group_of(item) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    items[:] = longest_first(items, groups)
