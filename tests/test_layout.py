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


# --- tests mirror the package; the harness is not the demo ---------------------------------------

#: Test folders that are not named after a subpackage of vllm_omni_mxfp4, and what they test.
OTHER_TEST_FOLDERS = {
    "support": "shared helpers",
    "demo": "the demo distribution (the demo program and its harness, vllm_omni_mxfp4_tiny)",
    "docs": "the documentation's commands, tables and messages",
    "examples": "examples/",
    "models": "every vLLM-Omni model family through the package (the model table)",
}
DEMO_PROGRAM = "vllm_omni_mxfp4_demo"
HARNESS = ROOT / "examples" / "demo" / "vllm_omni_mxfp4_tiny"


def test_every_test_folder_is_a_subpackage_or_says_what_it_tests() -> None:
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    strays = sorted(folders - parts - set(OTHER_TEST_FOLDERS))
    assert not strays, f"tests/{strays}: name a test folder after the subpackage it tests ({sorted(parts)})"


def demo_program_imports(paths: list[Path]) -> list[str]:
    """``file:line imports MODULE`` for each import of the demo program among ``paths``."""
    return sorted(
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in paths
        for line, module in imported_modules(path, ROOT)
        if _within(module, DEMO_PROGRAM)
    )


def test_only_the_demos_tests_import_the_demo_program() -> None:
    paths = [p for p in sorted(TESTS.rglob("*.py")) if p.relative_to(TESTS).parts[0] != "demo"]
    paths += sorted(HARNESS.rglob("*.py"))  # the harness is what the demo and the tests share
    problems = demo_program_imports(paths)
    assert not problems, (
        "the tests and the harness take tiny models, the engine job and the runner from "
        "vllm_omni_mxfp4_tiny, never from the demo program:\n" + "\n".join(problems)
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

P = "vllm_omni_mxfp4"

#: The rank of each part of the package (a module or a subpackage): a module imports only modules of
#: lower ranks or of its own part (lazy imports inside functions count; ``if TYPE_CHECKING:`` blocks
#: do not). docs/design.md draws the same table.
RANKS: dict[str, int] = {
    # 0: the standard library only: constants, the checkpoint-tensor table, errors, variables' names
    "spec": 0,
    "errors": 0,
    "_logging": 0,
    "patching": 0,
    "steps": 0,
    "envs": 1,
    # 1: numerics (torch) and safetensors files (numpy): the ground truth and the bytes
    "formats": 1,
    "safetensors_io": 1,
    # 2: pure configs and routing; other producers' layouts normalised to formats' types; the platform
    "config": 2,
    "sources": 2,
    "platform": 2,
    # 3: one kernel per (format, backend)
    "kernels": 3,
    # 4: the vLLM core: QuantizationConfig, Linear methods, per-layer state and loading
    "omni": 4,
    # 5: model classes built on meta, their derived names; the publishing of checkpoint directories
    "models": 5,
    "publish": 5,
    # 6: the merge, the convert, and the hooks into vLLM-Omni
    "checkpoint": 6,
    "convert": 6,
    "hooks": 6,
    # 7: the plugin and inspect; 8: compare (engines with inspect's report); 9: tune (one engine, compare's
    # measures); 10: the command line over them
    "plugin": 7,
    "inspection": 7,
    "compare": 8,
    "tune": 9,
    "cli": 10,
}


def part_of(module: str) -> str | None:
    """The part of :data:`RANKS` a package module belongs to (None: the package root or outside)."""
    if not module.startswith(P + "."):
        return None
    return module[len(P) + 1 :].split(".")[0]


def package_imports(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """Every package module -> ``(line, package module)`` for each of its imports inside the package."""
    graph = {}
    for path in sorted((root / P).rglob("*.py")):
        name = module_name(path, root)
        graph[name] = [(line, m) for line, m in imported_modules(path, root) if m.startswith(P + ".")]
    return graph


def rank_violations(root: Path = ROOT) -> list[str]:
    """``file:line imports module (part rank r -> part rank s)`` for each import of an equal or higher
    rank's part, and for each part missing from :data:`RANKS`."""
    problems = []
    for module, imports in package_imports(root).items():
        part = part_of(module)
        if part is None:
            continue
        if part not in RANKS:
            problems.append(f"{module}: part {part!r} has no rank in RANKS")
            continue
        for line, target in imports:
            other = part_of(target)
            if other == part or other is None:
                continue
            if RANKS.get(other, 99) >= RANKS[part]:
                path = module.replace(".", "/") + ".py"
                problems.append(
                    f"{path}:{line} imports {target} ({part} rank {RANKS[part]} -> {other} rank {RANKS.get(other)})"
                )
    return sorted(set(problems))


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected components of more than one module in the package's import graph
    (Tarjan), each sorted: every import cycle, lazy imports included."""
    graph = {m: sorted({t for _, t in imports if t != m}) for m, imports in package_imports(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / P / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_rank_check_counts_lazy_and_relative_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "spec.py": "",
            "formats/__init__.py": "from .mx import quantize\nfrom ..spec import MX_BLOCK\n",
            "formats/mx.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..config import Mxfp4Config\n"
                "def f():\n    from .. import envs\n    from ..kernels.base import X\n"
            ),
            "envs.py": "",
            "kernels/__init__.py": "",
            "kernels/base.py": "",
            "config/__init__.py": "",
            "newpart.py": "",
        },
    )
    assert rank_violations(root) == [
        f"{P}.newpart: part 'newpart' has no rank in RANKS",
        f"{P}/formats/mx.py:5 imports {P}.envs (formats rank 1 -> envs rank 1)",
        f"{P}/formats/mx.py:6 imports {P}.kernels.base (formats rank 1 -> kernels rank 3)",
    ]


def test_the_cycle_check_finds_lazy_cycles_within_a_part(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "omni/__init__.py": "",
            "omni/a.py": "from .b import x\n",
            "omni/b.py": "def f():\n    from .c import y\n",
            "omni/c.py": "def g():\n    from . import a\n",
            "omni/d.py": "from .a import x\n",
        },
    )
    assert import_cycles(root) == [[f"{P}.omni.a", f"{P}.omni.b", f"{P}.omni.c"]]


def test_every_import_goes_to_a_lower_rank() -> None:
    problems = rank_violations()
    assert not problems, "imports against the ranks of RANKS (docs/design.md, Layers):\n" + "\n".join(
        problems
    )


def test_the_import_graph_has_no_cycle() -> None:
    cycles = import_cycles()
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)


@dataclass(frozen=True)
class ImportRule:
    """Modules under ``package`` must not import any module under the ``forbidden`` prefixes:
    third-party boundaries the ranks do not express (no torch in the merge, no vLLM in configs)."""

    package: str
    forbidden: tuple[str, ...]
    why: str = ""


IMPORT_RULES = (
    ImportRule(
        f"{P}.checkpoint",
        ("torch", "vllm", "vllm_omni"),
        "the merge runs without torch and without the serving engine",
    ),
    ImportRule(f"{P}.publish", ("torch", "vllm", "vllm_omni"), "publishing moves bytes; it needs no torch"),
    ImportRule(f"{P}.safetensors_io", ("torch",), "the merge reads and writes safetensors with numpy"),
    ImportRule(f"{P}.config", ("torch", "vllm", "vllm_omni"), "configs parse and validate in pure Python"),
    ImportRule(f"{P}.spec", ("torch", "numpy", "vllm", "vllm_omni"), "spec is the standard library only"),
    ImportRule(
        f"{P}.platform",
        (f"{P}.spec", f"{P}.formats", f"{P}.config", f"{P}.sources"),
        "the CPU platform knows nothing of quantization",
    ),
    ImportRule(
        f"{P}.sources", ("vllm", "vllm_omni"), "a checkpoint source reads a producer's layout; no engine"
    ),
    ImportRule(f"{P}.convert", ("vllm", "vllm_omni"), "the offline convert runs without the serving engine"),
    *(
        ImportRule(
            f"{P}.models.{m}", ("torch", "vllm", "vllm_omni"), "the merge reads derived names without torch"
        )
        for m in ("__init__", "names", "wan", "derive")
    ),
    *(
        ImportRule(
            f"{P}.inspection.{module}",
            ("torch", "vllm", "vllm_omni"),
            "inspect reads headers; only models/ builds the class (torch, vLLM)",
        )
        for module in ("checks", "components", "report")
    ),
)


def _package_files(package: str, root: Path = ROOT) -> list[Path]:
    path = root.joinpath(*package.split("."))
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    if path.name == "__init__":
        return [path.with_suffix(".py")] if path.with_suffix(".py").exists() else []
    module = path.with_suffix(".py")
    return [module] if module.exists() else []


def rule_violations(rule: ImportRule, root: Path = ROOT) -> list[str]:
    problems = []
    for path in _package_files(rule.package, root):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_blocks(tree)
        for node in ast.walk(tree):
            if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
        for line, module in imported_modules(path, root):
            if any(_within(module, f) for f in rule.forbidden):
                problems.append(f"{path.relative_to(root)}:{line} imports {module}")
    return sorted(set(problems))


@pytest.mark.parametrize("rule", IMPORT_RULES, ids=lambda r: r.package.partition(".")[2])
def test_third_party_boundaries(rule: ImportRule) -> None:
    assert _package_files(rule.package), f"{rule.package} has no source files"
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
