"""``vllm_omni_mxfp4.envs``: every variable's default, accepted values and errors; nobody else reads them.

The table :data:`CASES` holds, per variable, its accessor, the value it returns when the variable
is unset, what each accepted spelling reads as, and spellings that must be refused. A variable
added to ``envs.VARIABLES`` without a row here fails :func:`test_every_variable_has_a_case`.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vllm_omni_mxfp4 import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_omni_mxfp4"
ENV_DOC = ROOT / "docs" / "environment.md"
PREFIX = "VLLM_OMNI_MXFP4_"


@dataclass(frozen=True)
class Case:
    accessor: Callable[[], Any]
    default: Any
    accepted: dict[str, Any]
    refused: tuple[str, ...] = ()
    free_text: tuple[str, ...] = field(default=())  # any text is accepted: examples read back as given


CASES: dict[str, Case] = {
    "VLLM_OMNI_MXFP4_BACKEND": Case(
        envs.backend,
        "auto",
        {"auto": "auto", "npu": "npu", "ROCM": "rocm", " emulated ": "emulated"},
        ("cuda", "npu,rocm", "emulate"),
    ),
    "VLLM_OMNI_MXFP4_EMULATED_MIRROR": Case(
        envs.emulated_mirror,
        "npu",
        {
            "npu": "npu",
            "rocm": "rocm:rceil",
            "rocm:rceil": "rocm:rceil",
            "ROCm:AITER_LEGACY": "rocm:aiter_legacy",
            "rocm:even": "rocm:even",
            "rocm:floor": "rocm:floor",
        },
        ("cuda", "rocm:uos", "rocm:", "npu:floor"),
    ),
    "VLLM_OMNI_MXFP4_EMULATED_CACHE": Case(
        envs.emulated_cache,
        True,
        {
            "1": True,
            "true": True,
            "Yes": True,
            "on": True,
            "0": False,
            "false": False,
            "no": False,
            "OFF": False,
        },
        ("2", "enabled", "y"),
    ),
    "VLLM_OMNI_MXFP4_EMULATED_COMPUTE": Case(
        envs.emulated_compute,
        "auto",
        {"auto": "auto", "float32": "float32", "FLOAT32": "float32"},
        ("bf16", "fp32", "float64"),
    ),
    "VLLM_OMNI_MXFP4_TRACE_FILE": Case(
        envs.trace_file, None, {}, free_text=("trace.jsonl", "/tmp/a b/trace.jsonl")
    ),
    "VLLM_OMNI_MXFP4_TRAJECTORY_DIR": Case(
        envs.trajectory_dir, None, {}, free_text=("compare-out/bf16", "/tmp/a b/steps")
    ),
    "VLLM_OMNI_MXFP4_KEEP_BF16": Case(
        envs.keep_bf16,
        False,
        {"1": True, "ON": True, "true": True, "0": False, "no": False},
        ("2", "keep", "bf16"),
    ),
    "VLLM_OMNI_MXFP4_CPU_PLATFORM": Case(
        envs.cpu_platform_mode,
        "auto",
        {
            "auto": "auto",
            "AUTO": "auto",
            "1": "on",
            "on": "on",
            "true": "on",
            "force": "on",
            "0": "off",
            "off": "off",
            "False": "off",
        },
        ("maybe", "yes", "2"),
    ),
    "VLLM_OMNI_MXFP4_CPU_DEVICES": Case(
        envs.cpu_devices, None, {"1": 1, "8": 8, " 16 ": 16}, ("0", "-2", "two", "1.5")
    ),
    "VLLM_OMNI_MXFP4_CPU_VISIBLE_DEVICES": Case(envs.cpu_visible_devices, None, {}, free_text=("0", "0,1,2")),
    "VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE": Case(
        envs.cpu_warmup_size,
        64,
        {"0": 0, "16": 16, " 128 ": 128, "512": 512},
        ("-16", "8", "100", "big", "64.0"),
    ),
    "VLLM_OMNI_MXFP4_CACHE": Case(envs.cache_dir, Path("~/.cache/vllm-omni-mxfp4").expanduser(), {}),
}


def test_every_variable_has_a_case() -> None:
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names)), "a variable is declared twice"
    assert set(names) == set(CASES), f"variables without a test case: {set(names) - set(CASES)}"
    assert all(name.startswith(PREFIX) for name in names)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("unset", ["absent", "empty", "blank"])
def test_default(name: str, unset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if unset == "absent":
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, "" if unset == "empty" else "   ")
    assert CASES[name].accessor() == CASES[name].default


@pytest.mark.parametrize(
    "name,raw,expected",
    [(name, raw, value) for name, case in CASES.items() for raw, value in case.accepted.items()],
)
def test_accepted_value(name: str, raw: str, expected: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    assert CASES[name].accessor() == expected


@pytest.mark.parametrize("name,raw", [(name, raw) for name, case in CASES.items() for raw in case.free_text])
def test_free_text_reads_back(name: str, raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    assert CASES[name].accessor() == raw


def test_cache_dir_expands_the_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("VLLM_OMNI_MXFP4_CACHE", "~/models")
    assert envs.cache_dir() == tmp_path / "models"


@pytest.mark.parametrize("name,raw", [(name, raw) for name, case in CASES.items() for raw in case.refused])
def test_refused_value_names_the_variable(name: str, raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError) as info:
        CASES[name].accessor()
    message = str(info.value)
    assert name in message and repr(raw.strip()) in message and "expected" in message


def test_accepted_text_lists_every_choice() -> None:
    """The documented ``accepted`` text names every spelling the parser takes (for choices)."""
    for name, case in CASES.items():
        if name in ("VLLM_OMNI_MXFP4_CPU_DEVICES", "VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE"):  # numbers, not choices
            continue
        accepted = next(v for v in envs.VARIABLES if v.name == name).accepted.lower()
        for raw in case.accepted:
            word = raw.strip().lower().split(":")[-1]
            assert word in accepted, f"{name}: {raw!r} is accepted but not documented"


def test_values_are_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_MXFP4_BACKEND", "npu")
    assert envs.backend() == "npu"
    monkeypatch.setenv("VLLM_OMNI_MXFP4_BACKEND", "emulated")
    assert envs.backend() == "emulated"
    bad = {v.name: "not-a-valid-value" for v in envs.VARIABLES}
    result = subprocess.run(
        [sys.executable, "-c", "import vllm_omni_mxfp4.envs"],
        env={**os.environ, **bad},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"importing envs read a variable: {result.stderr[-2000:]}"


# --- only envs.py reads the variables -------------------------------------------------------------


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` constants."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found[target.id] = node.value.value
    return found


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def _environment_keys(tree: ast.Module) -> list[ast.AST]:
    """Key expressions of environment reads: ``os.environ.get(k)``, ``os.environ[k]``, ``os.getenv(k)``,
    ``k in os.environ``."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                (func.attr in ("get", "pop", "setdefault") and _is_environ(func.value))
                or func.attr == "getenv"
            ):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)
    return keys


def environment_readers(root: Path = PACKAGE) -> list[str]:
    """Modules other than ``envs.py`` that read a ``VLLM_OMNI_MXFP4_*`` variable from the environment.

    A read counts when its key is such a name (a literal or a module constant), or when the key is
    computed (a parameter, say) in a module that also spells out such a name as a whole string.
    """
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "envs.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _module_strings(tree)
        names_in_module = any(
            isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and re.fullmatch(PREFIX + r"[A-Z0-9_]+", n.value)
            for n in ast.walk(tree)
        )
        for key in _environment_keys(tree):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                value = key.value
            elif isinstance(key, ast.Name) and key.id in constants:
                value = constants[key.id]
            else:
                value = PREFIX if names_in_module else ""
            if value.startswith(PREFIX):
                found.append(f"{path.relative_to(root.parent)}:{key.lineno}")
    return list(dict.fromkeys(found))


def test_the_scanner_finds_every_form_of_read(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "envs.py").write_text('import os\nos.environ.get("VLLM_OMNI_MXFP4_X")\n')
    (package / "clean.py").write_text(
        'import os\nos.environ.get("HOME")\nenv = dict(os.environ)\nenv["VLLM_OMNI_MXFP4_X"] = "1"\n'
        'os.environ["VLLM_PLUGINS"] = "cpu"\nMSG = "set VLLM_OMNI_MXFP4_X=1"\n'
    )
    (package / "reads.py").write_text(
        "import os\n"
        'NAME = "VLLM_OMNI_MXFP4_A"\n'
        "os.environ.get(NAME)\n"
        'os.getenv("VLLM_OMNI_MXFP4_B")\n'
        'x = os.environ["VLLM_OMNI_MXFP4_C"]\n'
        'y = "VLLM_OMNI_MXFP4_D" in os.environ\n'
        "def flag(name):\n    return os.environ.get(name)\n"
        'flag("VLLM_OMNI_MXFP4_E")\n'
    )
    found = environment_readers(package)
    assert found == [f"pkg/reads.py:{line}" for line in (3, 4, 5, 6, 8)]


def test_only_envs_reads_the_variables() -> None:
    readers = environment_readers()
    assert not readers, (
        "these modules read VLLM_OMNI_MXFP4_* variables themselves; use the accessors of "
        f"vllm_omni_mxfp4.envs instead: {readers}"
    )


# --- the documentation ----------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def documented_rows() -> list[str]:
    """The table rows ``docs/environment.md`` must hold, one per variable, in declaration order."""
    return [
        f"| `{v.name}` | {f'`{v.default}`' if v.default else 'unset'} | {_cell(v.accepted)} | {_cell(v.doc)} |"
        for v in envs.VARIABLES
    ]


def test_docs_list_every_variable() -> None:
    lines = ENV_DOC.read_text(encoding="utf-8").splitlines()
    table = [line for line in lines if line.startswith(f"| `{PREFIX}")]
    expected = documented_rows()
    assert table == expected, (
        f"{ENV_DOC.relative_to(ROOT)} differs from vllm_omni_mxfp4/envs.py; its table rows should be:\n"
        + "\n".join(expected)
    )


def test_design_notes_link_the_variables() -> None:
    assert "(environment.md)" in (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
