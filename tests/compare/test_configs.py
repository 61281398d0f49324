"""``compare``'s ``--config`` values: parsed, labelled, and refused before any engine starts."""

from __future__ import annotations

import json

import pytest

from vllm_omni_mxfp4.compare.run import Config, Request, Settings, compare, parse_config


def test_the_three_forms_and_labels(tmp_path):
    assert parse_config("mxfp4", 0) == Config("mxfp4-0", {"quantization": "mxfp4"})
    spec = {"method": "mxfp4", "svd_rank": 16}
    assert parse_config(f"svd={json.dumps(spec)}", 1) == Config("svd", {"quantization_config": spec})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec))
    assert parse_config(f"@{path}", 2) == Config("mxfp4-2", {"quantization_config": spec})
    per = {
        "transformer": {"method": "mxfp4", "ignored_layers": ["blocks.0.ffn.net_2"]},
        "transformer_2": "mxfp4",
    }
    path.write_text(json.dumps(per))  # tune writes this form where the experts differ
    assert parse_config(f"@{path}", 3) == Config("per-component-3", {"quantization_config": per})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"--config '\{not json': not valid JSON"),
        (
            '{"svd_rank": 16}',
            r"--config '\{\"svd_rank\": 16\}': The quantization config has keys \['svd_rank'\] but no 'method'",
        ),
        ('{"method": "mxfp4", "svd_rank": -1}', r"svd_rank must be a non-negative integer"),
        ("@/nonexistent/config.json", r"cannot read /nonexistent/config\.json"),
        ("bf16=mxfp4", r"the label 'bf16' is the reference's"),
        ("mx fp4", r"expected a method name \(mxfp4\), a JSON object"),
    ],
)
def test_bad_values_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_config(text, 0)


def test_a_config_the_engine_refuses_fails_before_any_engine(tmp_path):
    pytest.importorskip("vllm_omni")
    # as if parsing had let it by: the engine's own check refuses it before any engine starts
    bad = Config("bad", {"quantization_config": {"method": "mxfp4", "svd_rank": -1}})
    with pytest.raises(
        ValueError, match=r"--config bad: the engine refuses it: .*svd_rank must be a non-negative integer"
    ):
        compare("no-such-model", [bad], [Request("p", 0)], Settings(steps=1), tmp_path)
    twice = [parse_config("a=mxfp4", 0), parse_config("a=mxfp4", 1)]
    with pytest.raises(ValueError, match=r"config labels \['a'\] are given twice"):
        compare("no-such-model", twice, [Request("p", 0)], Settings(steps=1), tmp_path)
