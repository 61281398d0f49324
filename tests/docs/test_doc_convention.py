"""The doc-test harness itself: it finds what is marked, and it fails when the docs are wrong."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from doc_blocks import DocFormatError, check_output, message_in, parse_file, run_session, sessions


def _doc(tmp_path, text: str):
    path = tmp_path / "doc.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_markers_blocks_and_tables_are_found(tmp_path):
    path = _doc(
        tmp_path,
        """\
        # Title

        <!-- doc-test: run session=a slow timeout=30 append="--x 1" -->
        ```bash
        echo hi
        ```

        <!-- doc-test: output -->
        ```text
        hi
        ```

        ```python
        print(1)
        ```

        <!-- doc-test: keys mxfp4 -->
        | Key | Default |
        |---|---|
        | `backend` | `"auto"` |
        """,
    )
    blocks, tables = parse_file(path)
    assert [(b.lang, b.marker.kind if b.marker else None) for b in blocks] == [
        ("bash", "run"),
        ("text", "output"),
        ("python", None),
    ]
    run = blocks[0].marker
    assert run.options == {"session": "a", "timeout": "30", "append": "--x 1"} and run.flag("slow")
    assert tables[0].marker.args == ("mxfp4",) and tables[0].rows == [["`backend`", '`"auto"`']]
    (session,) = sessions((path,))
    assert session.slow and session.steps[0].outputs == [blocks[1]]


@pytest.mark.parametrize(
    "text,match",
    [
        ("<!-- doc-test: run -->\nsome prose\n", "must be followed by a code block or table"),
        ("<!-- doc-test: keys mxfp4 -->\n```bash\necho\n```\n", "does not apply to a code block"),
        ("<!-- doc-test: run -->\n| a |\n|---|\n| b |\n", "does not apply to a table"),
        ("```bash\necho\n", "unterminated code fence"),
        ("<!-- doc-test: run -->\n", "marker at the end of the file"),
    ],
)
def test_malformed_docs_are_errors(tmp_path, text, match):
    with pytest.raises(DocFormatError, match=match):
        parse_file(_doc(tmp_path, text))


def test_output_blocks_must_follow_a_run_block(tmp_path):
    path = _doc(tmp_path, "<!-- doc-test: output -->\n```text\nx\n```\n")
    with pytest.raises(DocFormatError, match="must follow a run block"):
        sessions((path,))


def _expected(tmp_path, text):
    path = _doc(
        tmp_path,
        f"<!-- doc-test: run -->\n```bash\ntrue\n```\n<!-- doc-test: output -->\n```text\n{text}```\n",
    )
    return parse_file(path)[0][1]


def test_output_lines_match_in_order_with_wildcards(tmp_path):
    output = "start\nmerged Wan2.2 -> /tmp/x (packed weights)\n  transformer <- a: 12 layers\nend\n"
    check_output(
        _expected(tmp_path, "merged ... -> ...(packed weights)\n...\ntransformer <- a: ... layers\n"), output
    )
    with pytest.raises(AssertionError, match="not found"):
        check_output(_expected(tmp_path, "end\nstart\n"), output)
    with pytest.raises(AssertionError, match="not found"):
        check_output(_expected(tmp_path, "transformer <- b\n"), output)


def test_a_session_fails_on_wrong_exit_status_or_output(tmp_path):
    ok = _doc(
        tmp_path,
        "<!-- doc-test: run exit=3 -->\n```bash\necho done; exit 3\n```\n<!-- doc-test: output -->\n```text\ndone\n```\n",
    )
    run_session(sessions((ok,))[0], tmp_path / "ok")
    (tmp_path / "bad").mkdir()
    wrong_exit = _doc(tmp_path / "bad", "<!-- doc-test: run -->\n```bash\nfalse\n```\n")
    with pytest.raises(AssertionError, match="exit status 1, documented 0"):
        run_session(sessions((wrong_exit,))[0], tmp_path / "bad")


def test_sessions_share_a_directory_and_run_in_order(tmp_path):
    path = _doc(
        tmp_path,
        """\
        <!-- doc-test: run session=s -->
        ```bash
        echo 41 > value.txt
        ```
        <!-- doc-test: run session=s -->
        ```python
        print(int(open("value.txt").read()) + 1)
        ```
        <!-- doc-test: output -->
        ```text
        42
        ```
        """,
    )
    (session,) = sessions((path,))
    work = tmp_path / "work"
    work.mkdir()
    run_session(session, work)
    assert (work / "examples").is_symlink()


def test_a_hanging_block_times_out_and_is_reaped(tmp_path):
    path = _doc(
        tmp_path, "<!-- doc-test: run timeout=2 -->\n```bash\nsleep 60 & echo $! > child.pid; wait\n```\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(AssertionError, match="did not finish within 2s"):
        run_session(sessions((path,))[0], work)
    import psutil

    pid = int((work / "child.pid").read_text())
    gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert gone, "the block's background child outlived the timeout"


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is None, reason="vllm-omni not installed")
def test_messages_quoted_from_upstream_are_found_in_its_sources():
    from doc_blocks import MessageSources

    sources = MessageSources()
    upstream = "Required weights were not initialized from checkpoint: ..."
    assert not message_in(upstream, sources.own) and sources.has(upstream)
    assert not sources.has("Required weights were not initialized from the moon: ...")
    assert message_in("num_bf16_fallback_layers=... is larger than the ... blocks of", sources.own)


def test_messages_are_found_only_in_order_inside_one_literal():
    literals = ["Checkpoint config.json declares quant_method=\x00 but the active config is \x00.", "other"]
    assert message_in(
        "Checkpoint config.json declares quant_method=... but the active config is ....", literals
    )
    assert not message_in("but the active config is ... Checkpoint config.json", literals)
    assert not message_in("declares quant_method=... other", literals)
