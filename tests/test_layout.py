"""The repository's shape, checked on the source files (``ast`` and text; nothing is imported).

* Tests take shared helpers from ``tests/support/`` or their own folder, never from another
  folder's ``test_*.py`` module.
* No function of the package is longer than :data:`MAX_FUNCTION_LINES` lines, counted from the
  ``def`` line to the last line, docstring included.
* The package's import graph is one-way: each rule in :data:`IMPORT_RULES` names the modules a
  subpackage must not import (lazy imports inside functions count; ``if TYPE_CHECKING:`` blocks do
  not).
* Nothing points at ``research/...`` notes that are not in the repository; the facts live in
  ``docs/`` (``docs/kernels.md`` for numerics and vendor kernels).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_omni_mxfp4"
TESTS = ROOT / "tests"
MAX_FUNCTION_LINES = 60


# --- reading imports ------------------------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted module name of ``path`` under ``root`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of import nodes inside ``if TYPE_CHECKING:`` (typing-only, never executed)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imported_modules(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """``(line, absolute module)`` for every import in the file.

    ``from a import b`` counts as importing ``a.b`` when that is a module under ``root``, else ``a``.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_blocks(tree)
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield node.lineno, submodule if _is_module(submodule, root) else base


def _is_module(module: str, root: Path) -> bool:
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# --- tests import helpers, not other folders' tests -----------------------------------------------


def _test_module_paths(tests_root: Path) -> dict[str, Path]:
    """Every ``test_*.py`` under ``tests_root`` by dotted name (as ``tests.x.test_y``) and bare name."""
    found: dict[str, Path] = {}
    for path in tests_root.rglob("test_*.py"):
        found[module_name(path, tests_root.parent)] = path
        found.setdefault(path.stem, path)  # rootdir-inserted folders import it by its bare name
    return found


def cross_folder_test_imports(tests_root: Path = TESTS) -> list[str]:
    """``file:line imports other/test_x.py`` for each import of a test module from another folder."""
    test_modules = _test_module_paths(tests_root)
    problems = []
    for path in sorted(tests_root.rglob("*.py")):
        for line, module in imported_modules(path, tests_root.parent):
            target = test_modules.get(module)
            if module == path.stem or (target is not None and (path.parent / f"{module}.py").exists()):
                continue  # a bare name resolves to the importer's own folder first
            if target is not None and target.parent != path.parent:
                problems.append(
                    f"{path.relative_to(tests_root.parent)}:{line} imports "
                    f"{target.relative_to(tests_root.parent)}"
                )
    return sorted(set(problems))


def test_the_test_import_scanner(tmp_path: Path) -> None:
    tests_root = tmp_path / "tests"
    for folder in ("a", "b", "support"):
        (tests_root / folder).mkdir(parents=True)
    (tests_root / "a" / "test_one.py").write_text("def make():\n    return 1\n")
    (tests_root / "a" / "test_two.py").write_text("from test_one import make\nimport tests.a.test_one\n")
    (tests_root / "support" / "layers.py").write_text("")
    (tests_root / "b" / "test_three.py").write_text(
        "from tests.support.layers import x\n"
        "from tests.a.test_one import make\n"
        "import tests.a.test_one as one\n"
        "from tests.a import test_one\n"
        "def lazy():\n    from test_one import make\n"
    )
    (tests_root / "b" / "helper.py").write_text("from ..a.test_one import make\n")
    assert cross_folder_test_imports(tests_root) == [
        "tests/b/helper.py:1 imports tests/a/test_one.py",
        "tests/b/test_three.py:2 imports tests/a/test_one.py",
        "tests/b/test_three.py:3 imports tests/a/test_one.py",
        "tests/b/test_three.py:4 imports tests/a/test_one.py",
        "tests/b/test_three.py:6 imports tests/a/test_one.py",
    ]


def test_no_test_module_is_imported_from_another_folder() -> None:
    problems = cross_folder_test_imports()
    assert not problems, (
        "move shared helpers into tests/support/ (or the folder's own helper module) instead of importing "
        "another folder's test module:\n" + "\n".join(problems)
    )


# --- function length -------------------------------------------------------------------------------


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (N lines)`` for every function or method over ``limit`` lines, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append((length, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return [f"{where} ({length} lines)" for length, where in sorted(found, key=lambda item: -item[0])]


def test_the_length_count_includes_def_and_docstring(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(57))
    (tmp_path / "m.py").write_text(f'@decorator\ndef f():\n    """Doc."""\n{body}\n    return 0\n')
    assert long_functions(tmp_path, limit=60) == []
    assert long_functions(tmp_path, limit=59) == [f"{tmp_path.name}/m.py:2 f (60 lines)"]


def test_no_function_is_longer_than_the_limit() -> None:
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(found)


# --- the import graph ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportRule:
    """Modules under ``package`` must not import any module under the ``forbidden`` prefixes
    (``allowed`` prefixes are exempt, e.g. the package itself or ``spec``)."""

    package: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    why: str = ""


P = "vllm_omni_mxfp4"
IMPORT_RULES = (
    ImportRule(
        f"{P}.formats",
        (P,),
        (f"{P}.formats", f"{P}.spec"),
        "formats/ is the numerics ground truth; it depends on nothing in the package but spec",
    ),
    ImportRule(
        f"{P}.checkpoint",
        ("torch", f"{P}.omni", f"{P}.kernels"),
        why="the merge runs without torch and without the serving engine",
    ),
    ImportRule(
        f"{P}.config", ("torch", "vllm", "vllm_omni"), why="configs parse and validate in pure Python"
    ),
    ImportRule(
        f"{P}.platform",
        (f"{P}.omni", f"{P}.kernels", f"{P}.config", f"{P}.checkpoint"),
        why="the CPU platform knows nothing of quantization",
    ),
    ImportRule(
        f"{P}.sources",
        (P, "vllm", "vllm_omni"),
        (f"{P}.sources", f"{P}.formats", f"{P}.spec"),
        "a checkpoint source reads a producer's layout into formats' types; the engine calls it, not back",
    ),
    ImportRule(f"{P}.kernels", (f"{P}.omni",), why="kernels serve the vLLM glue, not the other way round"),
    ImportRule(
        f"{P}.convert",
        (f"{P}.omni", f"{P}.kernels", f"{P}.platform", "vllm", "vllm_omni"),
        why="the offline convert runs without the serving engine: formats' numerics, sources' layouts, "
        "checkpoint's writer and staging",
    ),
    ImportRule(
        f"{P}.models",
        ("torch", "vllm", "vllm_omni", f"{P}.omni", f"{P}.kernels", f"{P}.checkpoint"),
        why="a model's runtime names come from inspection's build of vLLM-Omni's class, as plain data for "
        "the torch-free merge (which imports models lazily, never the other way round)",
    ),
    *(
        ImportRule(
            f"{P}.inspection.{module}",
            ("torch", "vllm", "vllm_omni"),
            why="inspect: only inspection/model.py builds the model (torch, vLLM); the rest reads headers",
        )
        for module in ("checks", "components", "records", "report")
    ),
)


def _package_files(package: str, root: Path = ROOT) -> list[Path]:
    path = root.joinpath(*package.split("."))
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    module = path.with_suffix(".py")
    return [module] if module.exists() else []


def rule_violations(rule: ImportRule, root: Path = ROOT) -> list[str]:
    problems = []
    for path in _package_files(rule.package, root):
        for line, module in imported_modules(path, root):
            if module == P or any(_within(module, a) for a in rule.allowed):
                continue  # the root package's __init__ imports nothing
            if any(_within(module, f) for f in rule.forbidden):
                problems.append(f"{path.relative_to(root)}:{line} imports {module}")
    return sorted(set(problems))


def test_the_import_scanner_resolves_relative_and_lazy_imports(tmp_path: Path) -> None:
    formats = tmp_path / P / "formats"
    formats.mkdir(parents=True)
    (tmp_path / P / "__init__.py").write_text("")
    (formats / "__init__.py").write_text("from .mx import quantize\nfrom ..spec import MX_BLOCK\n")
    (tmp_path / P / "envs.py").write_text("")
    (tmp_path / P / "spec.py").write_text("")
    (formats / "mx.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..config import Mxfp4Config\n"
        "def f():\n    from .. import envs\n    from ..kernels.base import X\n"
    )
    assert rule_violations(IMPORT_RULES[0], tmp_path) == [
        f"{P}/formats/mx.py:5 imports {P}.envs",
        f"{P}/formats/mx.py:6 imports {P}.kernels.base",
    ]


@pytest.mark.parametrize("rule", IMPORT_RULES, ids=lambda r: r.package.rpartition(".")[2])
def test_import_graph(rule: ImportRule) -> None:
    if not _package_files(rule.package):
        # backends/ was renamed kernels/; whichever of the two is absent has nothing to check.
        assert rule.package.endswith((".backends", ".kernels")), f"{rule.package} has no source files"
        pytest.skip(f"{rule.package} does not exist")
    problems = rule_violations(rule)
    assert not problems, f"{rule.package}: {rule.why}:\n" + "\n".join(problems)


# --- references to files the repository does not have ---------------------------------------------

REFERENCE_DIRS = ("vllm_omni_mxfp4", "tests", "docs", "examples", "tools", "bench", "scripts")


def missing_research_references(root: Path = ROOT) -> list[str]:
    """``file:line`` for each mention of a ``research/...`` file that is not in the repository."""
    found = []
    paths = [root / "README.md"] + [
        p for d in REFERENCE_DIRS for p in sorted((root / d).rglob("*")) if p.suffix in (".py", ".md", ".sh")
    ]
    for path in paths:
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in re.finditer(r"\bresearch/[\w./-]*\w", line):
                if not (root / match.group(0)).exists():
                    found.append(f"{path.relative_to(root)}:{number} {match.group(0)}")
    return found


def test_no_reference_to_research_notes_outside_the_repository() -> None:
    found = missing_research_references()
    assert not found, (
        "point these at docs/kernels.md (or another page under docs/) instead of notes the repository "
        "does not contain:\n" + "\n".join(found)
    )
