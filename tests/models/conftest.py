"""``--record-models``: measure every tiny model build and write docs/models_measured.json.

Without it, ``tests/models/test_online_models.py`` checks each measurement against that file (the
record ``tools/model_table.py`` renders into docs/models.md); with it, the same tests write what they
measured there instead, for a change that legitimately moves the numbers (a new vLLM-Omni, a new
model). Regenerate the docs afterwards: ``python tools/model_table.py``.
"""

from __future__ import annotations

import json

import pytest

from tests.support.models import table_tool


@pytest.fixture(scope="session")
def recorded_models(request: pytest.FixtureRequest):
    """``None`` when checking; with ``--record-models``, a dict the tests fill (key -> record), written
    to docs/models_measured.json (merged with the keys not run) when the session ends."""
    if not request.config.getoption("--record-models"):
        yield None
        return
    records: dict[str, dict] = {}
    yield records
    tool = table_tool()
    merged = {**tool.MEASURED, **records}
    tool.MEASURED_RESULTS.write_text(json.dumps(dict(sorted(merged.items())), indent=2) + "\n")
