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


def test_user_guide_model_table_is_current():
    tool = table_tool()
    current = tool.GUIDE.read_text(encoding="utf-8")
    assert current == tool.render_guide(current, list(scanned()), tool.e2e_records()), (
        f"the model table of docs/user_guide.md is out of date; regenerate it with: {tool.REGENERATE}"
    )


def test_offline_column_names_a_transformer_for_every_merge_model_type():
    """The offline column comes from the merge's MODEL_TYPES: each type's transformer class must be
    one of the table's (a renamed class would silently drop the type from the table)."""
    classes = {t.name for t in scanned() if t.takes_quant_config}
    offline = table_tool().offline_types()
    assert set(offline) <= classes, sorted(set(offline) - classes)
    assert {"Wan2.2-T2V-A14B", "Wan2.2-I2V-A14B", "Wan2.2-TI2V-5B"} <= set(offline["WanTransformer3DModel"])


def test_every_e2e_family_names_its_transformer(tmp_path):
    tool = table_tool()
    assert set(tool.e2e_records()) <= set(tool.E2E_FAMILIES), "add the family to E2E_FAMILIES"
    assert set(tool.E2E_FAMILIES.values()) <= {t.key for t in scanned()}
    results = tmp_path / "e2e.json"
    results.write_text(
        '{"families": {"qwen_image": {"title": "Qwen-Image", "pipeline": "QwenImagePipeline", "modes": '
        '{"bf16": {"cosine": 1.0, "psnr_db": "inf"}, "mxfp4": {"cosine": 0.99, "psnr_db": 40.14}}}, '
        '"z_image": {"title": "Z-Image", "unsupported": "no tiny pipeline: why"}}}'
    )
    rows = tool.guide_table(list(scanned()), tool.e2e_records(results))
    [qwen] = [r for r in rows if r.startswith("| `qwen_image.QwenImageTransformer2DModel`")]
    assert "Qwen-Image: mxfp4 0.99 / 40.1 dB" in qwen and "tiny pipeline through `Omni(...)`" in qwen
    [z_image] = [r for r in rows if r.startswith("| `z_image.ZImageTransformer2DModel`")]
    assert "Z-Image: not run ([why](e2e_models.md))" in z_image and "Omni" not in z_image


def test_every_transformer_that_takes_a_quant_config_is_a_case():
    """A class vLLM-Omni adds (or drops) fails here until tests/support/models.py builds it."""
    takes = {t.key for t in scanned() if t.takes_quant_config}
    assert takes == set(CASES), (
        f"not built by tests/support/models.py: {sorted(takes - set(CASES))}; "
        f"no longer in vLLM-Omni: {sorted(set(CASES) - takes)}"
    )


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
