"""``vllm-omni-mxfp4 tune`` refuses bad arguments with exit status 2 and a message naming the flag,
before any engine starts (each case is built from a valid command line)."""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.cli import main

VALID = ["tune", "no-such-model", "--prompt", "a cat", "--seed", "1", "--steps", "2"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--eval-seed", "1"], "evaluation requests [('a cat', 1)] are also tuning requests"),
        (["--method", "mxfp4_dualscale", "--max-w4a8-steps", "1"], "mxfp4_dualscale has no W4A8 fallback"),
        (["--max-bf16-fraction", "1.5"], "--max-bf16-fraction must be within [0, 1], got 1.5"),
        (["--max-bf16-layers", "-1"], "--max-bf16-layers must be >= 0, got -1"),
        (["--candidates", "-3"], "--candidates must be >= 1, got -3"),
        (
            ["--prompt-file", "/nonexistent/prompts.txt"],
            "--prompt / --prompt-file: cannot read /nonexistent/prompts.txt",
        ),
        (["--image", "/nonexistent/input.png"], "--image /nonexistent/input.png: no such file"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        status = main([*VALID, *extra])
        raise SystemExit(status)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


def test_no_prompt_is_refused(capsys):
    assert main(["tune", "no-such-model"]) == 2
    assert "--prompt / --prompt-file: give at least one prompt" in capsys.readouterr().err
