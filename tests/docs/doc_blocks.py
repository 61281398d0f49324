"""The doc-test convention: find the marked code blocks and tables of README.md and docs/, run them.

A marker is an HTML comment (invisible on GitHub) on the line right above a fenced code block or a
table::

    <!-- doc-test: KIND [option ...] -->

Kinds for code blocks:

- ``run``: run the block (``bash`` with ``-euo pipefail``, or ``python``) in a fresh temporary
  directory that holds links to the repository's ``examples/``, ``tools/`` and ``bench/``, with the
  test environment's ``bin/`` first on ``PATH`` (so ``python``, ``vllm`` and ``vllm-omni-mxfp4`` are
  the project's). Options: ``slow`` (the test is marked slow), ``timeout=SECONDS``, ``exit=CODE``
  (expected exit status, default 0), ``append="ARGS"`` (appended to the block's last line: a
  smaller run of the same command), ``session=NAME`` (blocks of one file with the same session run
  in order in one directory, as one test).
- ``server``: start the block in the background for the rest of its session (``session=`` is
  required, ``port=PORT`` names the port the block listens on; the test substitutes a free port
  for that number in every block of the session and waits for ``GET /health``). The process group
  is ended when the session ends.
- ``output``: a ``text`` block showing what the preceding ``run`` block prints. Each non-blank line
  must match a later output line than the previous one; ``...`` inside a line stands for any text,
  a line that is only ``...`` is ignored.
- ``config``: a ``json`` block that must parse as a quantization config (a checkpoint
  ``config.json`` fragment with a ``quantization_config`` key is parsed by that key).
- ``skip reason="..."``: not run (needs hardware, a real checkpoint, installs packages, ...).

Kinds for tables:

- ``config-errors``: each row's first code span (first column) is a JSON quantization spec that
  must be rejected, with an error message matching the first code span of the last column.
- ``keys METHOD``: the code spans of the first column are exactly the keys ``METHOD`` accepts, and
  the ``Default`` column holds each key's default as JSON.
- ``messages``: each row's first code span is an error message, ``...`` for the parts that vary;
  the pieces between them must appear, in order, in one string literal (f-string parts joined,
  implicit concatenation resolved) of this package, its examples, tools and scripts, or the
  installed vLLM-Omni.

Every ``bash``, ``sh``, ``shell``, ``console``, ``python`` and ``json`` block carries a marker, so no
command in the docs escapes testing unnoticed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.platform.omni_procs import reap_group
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
LINKED_DIRS = ("examples", "tools", "bench")
MARKED_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "python", "py", "json"})
BLOCK_KINDS = frozenset({"run", "server", "output", "config", "skip"})
TABLE_KINDS = frozenset({"config-errors", "keys", "messages"})
DEFAULT_TIMEOUT = {False: 180.0, True: 900.0}

_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)\s*$")
_CODE_SPAN = re.compile(r"`([^`]+)`")


def rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (for messages)."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


class DocFormatError(ValueError):
    """A marker or block that breaks the convention; the message names the file and line."""


@dataclass(frozen=True)
class Marker:
    kind: str
    args: tuple[str, ...] = ()
    options: dict[str, str] = field(default_factory=dict)

    def flag(self, name: str) -> bool:
        return name in self.args


@dataclass
class Block:
    """A fenced code block and its marker (``None`` when unmarked)."""

    path: Path
    line: int
    lang: str
    code: str
    marker: Marker | None

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


@dataclass
class Table:
    """A Markdown table after a table marker: header cells and data rows (cells as raw text)."""

    path: Path
    line: int
    marker: Marker
    header: list[str]
    rows: list[list[str]]

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def _parse_marker(body: str, where: str) -> Marker:
    try:
        tokens = shlex.split(body)
    except ValueError as exc:
        raise DocFormatError(f"{where}: cannot parse doc-test marker {body!r}: {exc}") from None
    if not tokens:
        raise DocFormatError(f"{where}: empty doc-test marker")
    kind, args, options = tokens[0], [], {}
    for token in tokens[1:]:
        key, eq, value = token.partition("=")
        if eq:
            options[key] = value
        else:
            args.append(token)
    return Marker(kind, tuple(args), options)


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def parse_file(path: Path) -> tuple[list[Block], list[Table]]:
    """Every fenced block (marked or not) and every marked table of one Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    tables: list[Table] = []
    pending: tuple[Marker, int] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        where = f"{rel(path)}:{i + 1}"
        marker_match = _MARKER.match(line)
        fence_match = _FENCE.match(line)
        if marker_match:
            if pending is not None:
                raise DocFormatError(f"{where}: two doc-test markers in a row")
            pending = (_parse_marker(marker_match["body"], where), i + 1)
        elif fence_match:
            indent, fence = fence_match["indent"], fence_match["fence"]
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                text = lines[j]
                body.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
                j += 1
            if j == len(lines):
                raise DocFormatError(f"{where}: unterminated code fence")
            marker = pending[0] if pending else None
            if marker is not None and marker.kind not in BLOCK_KINDS:
                raise DocFormatError(f"{where}: doc-test kind {marker.kind!r} does not apply to a code block")
            blocks.append(Block(path, i + 1, fence_match["lang"].lower(), "\n".join(body) + "\n", marker))
            pending = None
            i = j
        elif line.strip().startswith("|") and pending is not None:
            marker, _ = pending
            if marker.kind not in TABLE_KINDS:
                raise DocFormatError(f"{where}: doc-test kind {marker.kind!r} does not apply to a table")
            rows = []
            j = i
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(_split_row(lines[j]))
                j += 1
            if len(rows) < 3:
                raise DocFormatError(f"{where}: a marked table needs a header, a rule and rows")
            tables.append(Table(path, i + 1, marker, rows[0], rows[2:]))
            pending = None
            i = j - 1
        elif line.strip() and pending is not None:
            raise DocFormatError(
                f"{rel(path)}:{pending[1]}: a doc-test marker must be followed by a code block or table"
            )
        i += 1
    if pending is not None:
        raise DocFormatError(f"{rel(path)}:{pending[1]}: marker at the end of the file")
    return blocks, tables


def all_blocks() -> list[Block]:
    return [b for path in DOC_FILES for b in parse_file(path)[0]]


def all_tables() -> list[Table]:
    return [t for path in DOC_FILES for t in parse_file(path)[1]]


def code_spans(cell: str) -> list[str]:
    return _CODE_SPAN.findall(cell)


# --------------------------------------------------------------------------------------------------
# Sessions: what one test runs
# --------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """A run or server block, with the output blocks that document it."""

    block: Block
    outputs: list[Block] = field(default_factory=list)

    @property
    def marker(self) -> Marker:
        assert self.block.marker is not None
        return self.block.marker


@dataclass
class Session:
    """Steps run in order in one working directory (one test)."""

    name: str
    steps: list[Step]

    @property
    def slow(self) -> bool:
        return any(s.marker.flag("slow") for s in self.steps)

    @property
    def timeout(self) -> float:
        return sum(float(s.marker.options.get("timeout", DEFAULT_TIMEOUT[self.slow])) for s in self.steps)


def sessions(paths: tuple[Path, ...] = DOC_FILES) -> list[Session]:
    """The runnable content of the docs, one :class:`Session` per test."""
    found: list[Session] = []
    for path in paths:
        blocks, _ = parse_file(path)
        named: dict[str, Session] = {}
        last: Step | None = None
        for block in blocks:
            marker = block.marker
            if marker is None:
                continue
            if marker.kind == "output":
                if last is None:
                    raise DocFormatError(f"{block.where}: an output block must follow a run block")
                last.outputs.append(block)
                continue
            if marker.kind not in ("run", "server"):
                continue
            if block.lang not in ("bash", "sh", "shell", "python", "py"):
                raise DocFormatError(f"{block.where}: cannot run a {block.lang or 'plain'} block")
            step = Step(block)
            last = step
            session_name = marker.options.get("session")
            if marker.kind == "server" and (session_name is None or "port" not in marker.options):
                raise DocFormatError(f"{block.where}: a server block needs session=NAME and port=PORT")
            if session_name is None:
                found.append(Session(block.where, [step]))
            elif session_name in named:
                named[session_name].steps.append(step)
            else:
                named[session_name] = Session(f"{rel(path)}#{session_name}", [step])
                found.append(named[session_name])
    return found


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("VLLM_OMNI_MXFP4_CPU_PLATFORM", None)
    env.pop("PYTHONPATH", None)
    return env


def prepare_workdir(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    for name in LINKED_DIRS:
        (workdir / name).symlink_to(ROOT / name, target_is_directory=True)


def _command(block: Block, code: str, workdir: Path) -> list[str]:
    suffix = ".py" if block.lang in ("python", "py") else ".sh"
    script = workdir / f".doc-block-{block.line}{suffix}"
    script.write_text(code, encoding="utf-8")
    if suffix == ".py":
        return [sys.executable, script.name]
    return ["bash", "-euo", "pipefail", script.name]


def _with_append(code: str, marker: Marker) -> str:
    extra = marker.options.get("append")
    if not extra:
        return code
    lines = code.rstrip("\n").split("\n")
    lines[-1] = f"{lines[-1]} {extra}"
    return "\n".join(lines) + "\n"


def check_output(expected: Block, output: str) -> None:
    """Every non-blank expected line matches a later output line than the one before it."""
    out_lines = output.splitlines()
    position = 0
    for wanted in expected.code.splitlines():
        wanted = wanted.strip()
        if not wanted or wanted == "...":
            continue
        fragments = [f.strip() for f in wanted.split("...") if f.strip()]
        pattern = re.compile(".*".join(re.escape(f) for f in fragments))
        for index in range(position, len(out_lines)):
            if pattern.search(out_lines[index]):
                position = index + 1
                break
        else:
            raise AssertionError(
                f"{expected.where}: documented output line {wanted!r} not found (in order) in the "
                f"command's output:\n{output[-6000:]}"
            )


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} during start-up:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"server not healthy on port {port} within {timeout:.0f}s:\n{_tail(log)}")


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "<no output>"


def run_session(session: Session, workdir: Path) -> None:
    """Run every step of ``session`` in ``workdir``; AssertionError with the output on failure."""
    prepare_workdir(workdir)
    env = environment()
    ports = {s.marker.options["port"]: str(free_port()) for s in session.steps if s.marker.kind == "server"}
    servers: list[subprocess.Popen] = []
    try:
        for step in session.steps:
            code = _with_append(step.block.code, step.marker)
            for documented, actual in ports.items():
                code = re.sub(rf"\b{re.escape(documented)}\b", actual, code)
            command = _command(step.block, code, workdir)
            log = workdir / f".doc-block-{step.block.line}.log"
            timeout = float(step.marker.options.get("timeout", DEFAULT_TIMEOUT[step.marker.flag("slow")]))
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    command,
                    cwd=workdir,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if step.marker.kind == "server":
                servers.append(proc)
                _wait_healthy(int(ports[step.marker.options["port"]]), proc, log, timeout)
                continue
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                reap_group(proc, settle=0)
                raise AssertionError(
                    f"{step.block.where}: did not finish within {timeout:.0f}s; output:\n{_tail(log)}"
                ) from None
            reap_group(proc, settle=0)
            expected = int(step.marker.options.get("exit", "0"))
            output = log.read_text(errors="replace")
            if proc.returncode != expected:
                raise AssertionError(
                    f"{step.block.where}: exit status {proc.returncode}, documented {expected}; output:\n"
                    f"{output[-6000:]}"
                )
            for documented_output in step.outputs:
                check_output(documented_output, output)
    finally:
        for server in servers:
            reap_group(server, settle=0, term_grace=30.0)


# --------------------------------------------------------------------------------------------------
# Messages quoted in the docs
# --------------------------------------------------------------------------------------------------

_PLACEHOLDER = "\x00"


def _constants(tree) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (e.g. environment variable names)."""
    import ast

    found = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found[target.id] = node.value.value
    return found


def _literals(tree, constants: dict[str, str]) -> list[str]:
    """Every string literal of a module; an f-string's replacement fields become placeholders,
    except names of string constants, which are filled in."""
    import ast

    def field(value) -> str:
        inner = value.value
        if isinstance(inner, ast.Name) and inner.id in constants and value.conversion == -1:
            return constants[inner.id]
        return _PLACEHOLDER

    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            texts.append("".join(v.value if isinstance(v, ast.Constant) else field(v) for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
    return texts


def _parse_file(path: Path):
    import ast

    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return None


def _parse_tree(root: Path) -> list:
    return [tree for path in sorted(root.rglob("*.py")) if (tree := _parse_file(path)) is not None]


class MessageSources:
    """The string literals a documented message may come from: this project's sources, and
    vLLM-Omni's for the few messages the docs quote from upstream.

    Upstream has thousands of modules; parsing them all costs ~20 s, for three messages. So a message
    not found in this project's literals is looked up only in the upstream files whose raw text holds
    its longest word (a literal holds its words verbatim), each parsed once.
    """

    def __init__(self) -> None:
        import importlib.util

        own = [
            t
            for name in ("vllm_omni_mxfp4", "examples", "tools", "scripts")
            for t in _parse_tree(ROOT / name)
        ]
        # String constants of this package fill f-string fields; a name with two values is left out.
        constants: dict[str, str] = {}
        clashes: set[str] = set()
        for tree in own:
            for name, value in _constants(tree).items():
                if constants.get(name, value) != value:
                    clashes.add(name)
                constants[name] = value
        for name in clashes:
            constants.pop(name)
        self.constants = constants
        self.own = [text for tree in own for text in _literals(tree, constants)]
        spec = importlib.util.find_spec("vllm_omni")
        roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
        self._upstream = {
            path: path.read_text(encoding="utf-8", errors="replace")
            for r in roots
            for path in sorted(r.rglob("*.py"))
        }
        self._parsed: dict[Path, list[str]] = {}

    def _upstream_literals(self, path: Path) -> list[str]:
        if path not in self._parsed:
            tree = _parse_file(path)
            self._parsed[path] = [] if tree is None else _literals(tree, self.constants)
        return self._parsed[path]

    def has(self, message: str) -> bool:
        """Whether ``message`` (pieces between ``...``) is in one literal of the sources."""
        if message_in(message, self.own):
            return True
        words = [w for piece in message.split("...") for w in piece.split()]
        if not words:
            return False
        longest = max(words, key=len)
        return any(
            message_in(message, self._upstream_literals(path))
            for path, raw in self._upstream.items()
            if longest in raw
        )


def message_in(message: str, literals: list[str]) -> bool:
    """Whether the pieces of ``message`` between ``...`` appear in order in one literal."""
    pieces = [p for p in (piece.strip() for piece in message.split("...")) if p]
    for text in literals:
        position = 0
        for piece in pieces:
            found = text.find(piece, position)
            if found < 0:
                break
            position = found + len(piece)
        else:
            return True
    return False
