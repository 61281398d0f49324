#!/usr/bin/env python3
"""Generate docs/cli.md, the command-line reference, from the programs' argument parsers.

    python tools/gen_cli_docs.py           # rewrite docs/cli.md
    python tools/gen_cli_docs.py --check   # exit 1 with a diff when docs/cli.md is out of date

The reference is rendered from each parser's actions (options, defaults, choices, help, mutually
exclusive groups), not from argparse's terminal help, so the output does not depend on the
terminal width or the Python version. ``tests/docs/test_cli_reference.py`` fails when the file is
out of date.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "cli.md"
EXAMPLE = ROOT / "examples" / "offline_inference" / "text_to_video" / "text_to_video.py"
REGENERATE = "python tools/gen_cli_docs.py"


@dataclass(frozen=True)
class Program:
    """One documented command line: how it is invoked and where its parser comes from."""

    invocation: str
    load_parser: Callable[[], argparse.ArgumentParser]
    note: str = ""


def _cli_parser() -> argparse.ArgumentParser:
    from vllm_omni_mxfp4.cli import build_parser

    return build_parser()


def _example_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("text_to_video_example", EXAMPLE)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot load the example {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _demo_parser() -> argparse.ArgumentParser:
    return importlib.import_module("vllm_omni_mxfp4_demo.modes").build_parser()


def _models_parser() -> argparse.ArgumentParser:
    return importlib.import_module("vllm_omni_mxfp4_demo.models").build_parser()


def _trained_wan_parser() -> argparse.ArgumentParser:
    return importlib.import_module("vllm_omni_mxfp4_tiny.trained_wan").build_parser()


def _trained_flux_parser() -> argparse.ArgumentParser:
    return importlib.import_module("vllm_omni_mxfp4_tiny.trained_flux").build_parser()


PROGRAMS: tuple[Program, ...] = (
    Program(
        "vllm-omni-mxfp4",
        _cli_parser,
        "Installed as a console script with the package. `python tools/merge_mxfp4_dualscale_checkpoint.py` "
        "takes exactly the arguments of `vllm-omni-mxfp4 merge`.",
    ),
    Program(
        "python examples/offline_inference/text_to_video/text_to_video.py",
        _example_parser,
        "Run from a source checkout.",
    ),
    Program(
        "python -m vllm_omni_mxfp4_demo",
        _demo_parser,
        "The demo's own package (`pip install -e examples/demo`). `scripts/demo.sh` builds the environment "
        "on first use and passes its arguments to this program.",
    ),
    Program(
        "python -m vllm_omni_mxfp4_demo.models",
        _models_parser,
        "The end-to-end runs of every model family ([e2e_models.md](e2e_models.md)), in the demo's package.",
    ),
    Program(
        "python -m vllm_omni_mxfp4_tiny.trained_wan",
        _trained_wan_parser,
        "Trains the tiny two-expert Wan2.2 on the synthetic task (vllm_omni_mxfp4_tiny/task.py) and writes "
        "it with a manifest of its recipe, measured numbers and SHA-256s; in the demo's package.",
    ),
    Program(
        "python -m vllm_omni_mxfp4_tiny.trained_flux",
        _trained_flux_parser,
        "Trains the tiny FLUX.1-dev text-to-image pipeline on the synthetic task's still images and writes "
        "it with a manifest of its recipe, measured numbers and SHA-256s; in the demo's package.",
    ),
)


def _slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _paragraphs(text: str | None) -> list[str]:
    """A parser description as Markdown: indented lines become text blocks, other lines paragraphs."""
    if not text:
        return []
    out: list[str] = []
    for chunk in text.strip("\n").split("\n\n"):
        lines = chunk.split("\n")
        if all(line.startswith("    ") or not line.strip() for line in lines):
            body = "\n".join(line[4:] for line in lines)
            out.append(f"```text\n{body}\n```")
        else:
            out.append(" ".join(line.strip() for line in lines if line.strip()))
    return out


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        text = text % {**params, "prog": prog}
    return text


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if isinstance(action.metavar, tuple):
        name = " ".join(action.metavar)
    else:
        name = action.metavar or action.dest.upper()
    if action.nargs in ("+", "*"):
        return f" {name} [{name} ...]" if action.nargs == "+" else f" [{name} ...]"
    if action.nargs == "?":
        return f" [{name}]"
    if isinstance(action.nargs, int) and action.nargs > 1:
        return " " + " ".join([name] * action.nargs)
    return f" {name}"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:
        return "off" if action.default in (False, None) else "on"
    default = action.default
    if default is None or default is argparse.SUPPRESS:
        return "—"
    if isinstance(default, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in default):
        return "`" + " ".join(str(v) for v in default) + "`"
    if isinstance(default, str):
        return f"`{default}`" if default else '`""`'
    if isinstance(default, (int, float)):
        return f"`{default}`"
    return "see description"  # an object (e.g. parsed modes): its repr is neither stable nor readable


def _exclusive_with(parser: argparse.ArgumentParser) -> dict[argparse.Action, list[str]]:
    partners: dict[argparse.Action, list[str]] = {}
    for group in parser._mutually_exclusive_groups:
        for action in group._group_actions:
            partners[action] = [
                a.option_strings[-1] for a in group._group_actions if a is not action and a.option_strings
            ]
    return partners


def _options_table(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    rows = ["| Option | Default | Description |", "|---|---|---|"]
    exclusive = _exclusive_with(parser)
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help is argparse.SUPPRESS:
            continue
        flags = ", ".join(action.option_strings) if action.option_strings else action.dest
        described = _help(action, prog)
        if action.choices is not None:
            described += " One of: " + ", ".join(f"`{c}`" for c in action.choices) + "."
        partners = [
            o for o in exclusive.get(action, []) if not re.search(rf"{re.escape(o)}(?![\w-])", described)
        ]
        if partners:
            described += " Mutually exclusive with " + ", ".join(f"`{o}`" for o in partners) + "."
        rows.append(f"| `{flags}{_metavar(action)}` | {_default(action)} | {_cell(described)} |")
    return rows if len(rows) > 2 else []


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            found.extend((name, helps.get(name, ""), sub) for name, sub in action.choices.items())
    return found


def _synopsis(parser: argparse.ArgumentParser, invocation: str) -> str:
    parts = [invocation]
    optional = False
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.required or not action.option_strings:
            flag = action.option_strings[0] if action.option_strings else ""
            parts.append((flag + _metavar(action)).strip())
        else:
            optional = True
    if optional:
        parts.append("[options]")
    return " ".join(parts)


def _section(parser: argparse.ArgumentParser, invocation: str, note: str, level: int) -> list[str]:
    subcommands = _subcommands(parser)
    out = [f"{'#' * level} `{invocation}`", ""]
    if subcommands:
        out += _paragraphs(parser.description)
        out += ["", "| Command | Purpose |", "|---|---|"]
        out += [
            f"| [`{name}`](#{_slug(f'{invocation} {name}')}) | {_cell(text)} |"
            for name, text, _ in subcommands
        ]
        if note:
            out += ["", note]
        out.append("")
        for name, _, sub in subcommands:
            out += _section(sub, f"{invocation} {name}", "", level + 1)
        return out
    out += ["```text", _synopsis(parser, invocation), "```", ""]
    for paragraph in _paragraphs(parser.description):
        out += [paragraph, ""]
    if note:
        out += [note, ""]
    table = _options_table(parser, invocation)
    if table:
        out += [*table, ""]
    for paragraph in _paragraphs(parser.epilog):
        out += [paragraph, ""]
    return out


def render() -> str:
    """The complete text of docs/cli.md."""
    lines = [
        "# Command-line reference",
        "",
        f"<!-- Generated from the argument parsers by tools/gen_cli_docs.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "Every option of every program, taken from its argument parser. `--help` on any program prints the same.",
        "",
    ]
    lines += [f"- [`{p.invocation}`](#{_slug(p.invocation)})" for p in PROGRAMS]
    lines.append("")
    for program in PROGRAMS:
        lines += _section(program.load_parser(), program.invocation, program.note, 2)
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="Compare instead of writing; exit 1 if different."
    )
    args = parser.parse_args(argv)
    text = render()
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
    if args.check:
        if current == text:
            print(f"{OUTPUT.relative_to(ROOT)} is up to date")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True), text.splitlines(keepends=True), "docs/cli.md", "generated"
        )
        sys.stdout.writelines(diff)
        print(f"\n{OUTPUT.relative_to(ROOT)} is out of date; regenerate it with: {REGENERATE}")
        return 1
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(PROGRAMS)} programs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
