"""The command line: parser structure and size parsing (the merge itself is tested in test_merge.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from vllm_omni_mxfp4.cli import build_parser, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1000", 1000),
        ("5GB", 5 * 10**9),
        ("5gb", 5 * 10**9),
        ("500 MB", 500 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2KB", 2000),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "5XB", "-1GB", "0", "0.0001KB", "", "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_size(text)


def test_merge_subcommand_arguments():
    args = build_parser().parse_args(
        ["merge", "--model-type", "auto", "--original-model", "a", "--quant-path", "b", "--output-path", "c"]
    )
    assert (args.command, args.model_type, args.weight_layout, args.max_shard_size) == (
        "merge",
        "auto",
        "packed",
        None,
    )
    assert (args.dry_run, args.overwrite, args.json, args.non_block_quantized) == (
        False,
        False,
        False,
        "error",
    )
    args = build_parser().parse_args(
        ["merge", "--model-type", "Wan2.2-I2V-A14B", "--original-model", "a", "--quant-path", "b"]
        + [
            "--output-path",
            "c",
            "--weight-layout",
            "numeric",
            "--max-shard-size",
            "2GB",
            "--dry-run",
            "--json",
        ]
    )
    assert (args.weight_layout, args.max_shard_size, args.dry_run, args.json) == (
        "numeric",
        2 * 10**9,
        True,
        True,
    )
    for bad in (["--model-type", "Wan2.1-T2V-14B"], ["--weight-layout", "nibbles"]):
        argv = [
            "merge",
            "--model-type",
            "auto",
            "--original-model",
            "a",
            "--quant-path",
            "b",
            "--output-path",
            "c",
        ]
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv + bad)


def test_the_merge_imports_no_torch():
    """The merge streams bytes and validates with numpy: importing it must not pull in torch."""
    code = (
        "import sys, vllm_omni_mxfp4.checkpoint, vllm_omni_mxfp4.cli\n"
        "print(sorted(m for m in ('torch', 'vllm', 'vllm_omni') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"
