"""Facts the docs state that are not commands: variables, links, extras, the two set-up scripts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import DOC_FILES, ROOT, rel

ENV_VAR = re.compile(r"\bVLLM_OMNI_MXFP4_[A-Z0-9_]+\b")
LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")
PIP_EXTRA = re.compile(r"vllm-omni-mxfp4\[([a-z0-9_,-]+)\]")
SOURCE_DIRS = ("vllm_omni_mxfp4", "scripts", "examples", "bench", "tools")


def _doc_text() -> dict[Path, str]:
    return {path: path.read_text(encoding="utf-8") for path in DOC_FILES}


def _source_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".sh")]


def test_environment_variables_are_documented_and_exist():
    documented = {v for text in _doc_text().values() for v in ENV_VAR.findall(text)}
    defined = {v for path in _source_files() for v in ENV_VAR.findall(path.read_text(encoding="utf-8"))}
    assert documented - defined == set(), f"documented but used nowhere in the source: {documented - defined}"
    assert defined - documented == set(), f"read by the code but not documented: {defined - documented}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    anchors = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().replace("`", "")
        slug = "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_relative_links_and_anchors_resolve():
    broken = []
    for path, text in _doc_text().items():
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{rel(path)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{rel(path)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_documented_pip_extras_exist():
    from importlib.metadata import metadata

    extras = metadata("vllm-omni-mxfp4").get_all("Provides-Extra") or []
    documented = {
        e for text in _doc_text().values() for group in PIP_EXTRA.findall(text) for e in group.split(",")
    }
    assert documented, "the README documents the extras"
    assert documented <= set(extras), f"unknown extras in the docs: {documented - set(extras)}"


def _python_dirs() -> set[str]:
    """Top-level directories of the repository that hold Python files (tracked or not)."""
    skip = {".venv", ".git", "build", "dist", "outputs"}
    found = set()
    for path in ROOT.iterdir():
        visible = path.is_dir() and path.name not in skip and not path.name.startswith(".")
        if visible and any(path.rglob("*.py")):
            found.add(path.name)
    return found


def test_test_sh_lints_every_python_directory_then_runs_pytest():
    """The README says scripts/test.sh is ruff + pytest over the project (run it, not this, in CI)."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    lint = next(line for line in script.splitlines() if '/ruff" check' in line)
    fmt = next(line for line in script.splitlines() if '/ruff" format --check' in line)
    for name in _python_dirs():
        assert re.search(rf"\b{name}\b", lint), f"scripts/test.sh does not lint {name}/"
        assert re.search(rf"\b{name}\b", fmt), f"scripts/test.sh does not format-check {name}/"
    assert re.search(r"-m pytest", script) and "env.sh" in script
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text(), "CI must run the README's test command"


def test_demo_sh_runs_the_demo_module():
    script = (ROOT / "scripts" / "demo.sh").read_text()
    assert re.search(r'exec "\$venv/bin/python" -m vllm_omni_mxfp4_demo "\$@"', script)
    assert "env.sh" in script


@pytest.mark.parametrize("module", ["vllm_omni_mxfp4_demo"])
def test_demo_module_answers_help(module):
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout
