"""Doc tests: every marked block and table of README.md and docs/*.md runs or is checked.

The convention is described in ``doc_blocks.py``. Sessions that start engines are marked slow.
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from doc_blocks import (
    MARKED_LANGUAGES,
    all_blocks,
    all_tables,
    code_spans,
    run_session,
    sessions,
)

from vllm_omni_mxfp4.config import CONFIG_CLASSES, parse_quantization

BLOCKS = all_blocks()
TABLES = all_tables()
SESSIONS = sessions()


def test_every_command_block_is_marked():
    unmarked = [b.where for b in BLOCKS if b.lang in MARKED_LANGUAGES and b.marker is None]
    assert not unmarked, (
        "code blocks without a doc-test marker (add <!-- doc-test: run --> or "
        f'<!-- doc-test: skip reason="..." --> above them): {unmarked}'
    )


def test_skipped_blocks_say_why():
    silent = [
        b.where for b in BLOCKS if b.marker and b.marker.kind == "skip" and not b.marker.options.get("reason")
    ]
    assert not silent, f'skip markers need reason="...": {silent}'


def test_docs_run_something():
    """A guard against a parser that silently finds nothing."""
    assert len(SESSIONS) >= 10 and len([t for t in TABLES if t.marker.kind == "keys"]) == 2


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.marker and b.marker.kind == "config"], ids=lambda b: b.where
)
def test_config_block_parses(block):
    assert block.lang == "json", f"{block.where}: a config block must be json"
    value = json.loads(block.code)
    if isinstance(value, dict) and "quantization_config" in value:
        value = value["quantization_config"]
    assert parse_quantization(value) is not None


def _error_rows():
    for table in TABLES:
        if table.marker.kind == "config-errors":
            for row in table.rows:
                yield pytest.param(table, row, id=f"{table.where}:{code_spans(row[0])[0][:40]}")


@pytest.mark.parametrize("table,row", list(_error_rows()))
def test_documented_config_error(table, row):
    spec = json.loads(code_spans(row[0])[0])
    message = code_spans(row[-1])[0]
    with pytest.raises((ValueError, TypeError)) as info:
        parse_quantization(spec)
    actual = str(info.value)
    fragments = [f.strip() for f in message.split("...") if f.strip()]
    position = 0
    for fragment in fragments:
        found = actual.find(fragment, position)
        assert found >= 0, (
            f"{table.where}: documented error {message!r} does not match the actual error {actual!r}"
        )
        position = found + len(fragment)
    if not message.startswith("..."):
        assert actual.startswith(fragments[0]), (
            f"{table.where}: {actual!r} does not start with {fragments[0]!r}"
        )


@pytest.mark.parametrize(
    "table", [t for t in TABLES if t.marker.kind == "keys"], ids=lambda t: f"{t.where}:{t.marker.args}"
)
def test_documented_keys_and_defaults(table):
    (method,) = table.marker.args
    cls = CONFIG_CLASSES[method]
    default_column = table.header.index("Default")
    documented: set[str] = set()
    for row in table.rows:
        keys = code_spans(row[0])
        documented.update(keys)
        field = next((f for f in fields(cls) if f.name == keys[0]), None)
        if field is None:
            continue
        default = getattr(cls(), field.name)  # the validated default, what a config without the key holds
        expected = list(default) if isinstance(default, tuple) else default
        (shown,) = code_spans(row[default_column])
        assert json.loads(shown) == expected, (
            f"{table.where}: default of {keys[0]} is {expected!r}, not {shown}"
        )
    assert documented == set(cls.valid_keys()), (
        f"{table.where}: documented keys differ from the config's: missing "
        f"{sorted(set(cls.valid_keys()) - documented)}, unknown {sorted(documented - set(cls.valid_keys()))}"
    )


def _session_params():
    for session in SESSIONS:
        marks = [pytest.mark.slow] if session.slow else []
        yield pytest.param(session, id=session.name, marks=marks)


@pytest.mark.parametrize("session", list(_session_params()))
def test_doc_session_runs(session, tmp_path):
    run_session(session, tmp_path)


def _message_rows():
    for table in TABLES:
        if table.marker.kind == "messages":
            for row in table.rows:
                yield pytest.param(
                    table, code_spans(row[0])[0], id=f"{table.where}:{code_spans(row[0])[0][:50]}"
                )


@pytest.fixture(scope="module")
def sources():
    from doc_blocks import MessageSources

    return MessageSources()


@pytest.mark.parametrize("table,message", list(_message_rows()))
def test_documented_message_exists_in_the_source(table, message, sources):
    assert sources.has(message), (
        f"{table.where}: the documented message {message!r} is not in the source any more; update the docs"
    )
