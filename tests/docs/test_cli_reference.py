"""docs/cli.md is what tools/gen_cli_docs.py renders from the argument parsers today."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from doc_blocks import ROOT

GENERATOR = ROOT / "tools" / "gen_cli_docs.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_cli_docs", module)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    gen = _generator()
    current = gen.OUTPUT.read_text(encoding="utf-8") if gen.OUTPUT.exists() else ""
    assert current == gen.render(), f"docs/cli.md is out of date; regenerate it with: {gen.REGENERATE}"


def test_every_option_of_every_program_is_in_the_reference():
    """Guards the renderer itself: nothing a parser accepts is left out."""
    gen = _generator()
    text = gen.render()
    parsers = [p.load_parser() for p in gen.PROGRAMS]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for option in action.option_strings or [action.dest]:
                    assert f"`{option}" in text or f", {option}" in text, (
                        f"{option} of {parser.prog} is missing"
                    )
