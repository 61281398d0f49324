"""docs/models.md is what tools/model_table.py generates from the installed vLLM-Omni today, and the
scan behind it finds what it claims to find."""

from __future__ import annotations

import textwrap

from tests.support.models import CASES, scanned, table_tool


def test_model_table_is_current():
    tool = table_tool()
    current = tool.OUTPUT.read_text(encoding="utf-8") if tool.OUTPUT.exists() else ""
    assert current == tool.render(list(scanned())), (
        f"docs/models.md is out of date; regenerate it with: {tool.REGENERATE}"
    )


def test_every_case_is_a_transformer_that_takes_a_quant_config():
    found = {t.key: t for t in scanned()}
    for key in CASES:
        assert key in found, f"{key} is no longer in the installed vLLM-Omni"
        assert found[key].takes_quant_config, key
        assert found[key].vllm_linears_with_config > 0, key


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_scan_rules(tmp_path):
    """The scan's rules on a synthetic models package: denoiser names, quant_config through the
    constructor (own, same-file base, base in another file), Linear counts per file."""
    _write(
        tmp_path,
        "a/a_transformer.py",
        """
        class ABlock(nn.Module):
            def __init__(self, quant_config=None):
                self.q = QKVParallelLinear(8, 4, 2, quant_config=quant_config)
                self.o = RowParallelLinear(8, 8, quant_config=None)
                self.m = ReplicatedLinear(8, 8)
                self.p = nn.Linear(8, 8)

        class ATransformer2DModel(nn.Module):
            def __init__(self, dim=8, quant_config=None):
                pass

        class AKontextTransformer2DModel(ATransformer2DModel):
            pass

        class ATextModel(nn.Module):
            def __init__(self, quant_config=None):
                pass
        """,
    )
    _write(
        tmp_path,
        "b/b.py",
        """
        from ..a.a_transformer import ATransformer2DModel

        class BTransformer3DModel(ATransformer2DModel):
            pass

        class CDiTModel(nn.Module):
            def __init__(self, dim=8):
                self.p = nn.Linear(8, 8)
        """,
    )
    found = {t.key: t for t in table_tool().scan(tmp_path)}
    assert set(found) == {
        "a.ATransformer2DModel",
        "a.AKontextTransformer2DModel",
        "b.BTransformer3DModel",
        "b.CDiTModel",
    }
    assert [found[k].takes_quant_config for k in sorted(found)] == [True, True, True, False]
    a = found["a.ATransformer2DModel"]
    assert (a.vllm_linears_with_config, a.vllm_linears_without_config, a.plain_linears) == (1, 2, 1)
    c = found["b.CDiTModel"]
    assert (c.vllm_linears_with_config, c.vllm_linears_without_config, c.plain_linears) == (0, 0, 1)
