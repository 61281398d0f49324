"""Per-family BF16 defaults: applied where vLLM-Omni builds the transformer, online, only when the user
lists no ignored_layers; logged; each one a published MXFP4 recipe's exclusions.

Qwen-Image: msModelSlim 26.1's lab_practice/qwen_image_edit/qwen-image-edit-w4a4f4-mxfp.yaml excludes
``*txt_mlp.net.2*``, ``*img_mod.1*`` and ``*txt_mod.1*`` from linear_quant (read from the installed
msModelSlim below, so a changed recipe fails here).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.support.models import QWEN_IMAGE, build, scanned
from vllm_omni_mxfp4.config.defaults import FAMILY_DEFAULTS
from vllm_omni_mxfp4.config.defaults import QWEN_IMAGE as QWEN_DEFAULT
from vllm_omni_mxfp4.config.routing import LayerRoute, Precision

QWEN_RECIPE = "lab_practice/qwen_image_edit/qwen-image-edit-w4a4f4-mxfp.yaml"


def _methods(model) -> dict:
    return {n: m.quant_method for n, m in model.named_modules() if hasattr(m, "quant_method")}


def test_qwen_default_is_the_recipes_exclude_list():
    yaml = pytest.importorskip("yaml")
    msmodelslim = pytest.importorskip("msmodelslim")
    recipe = yaml.safe_load((Path(msmodelslim.__file__).parent / QWEN_RECIPE).read_text(encoding="utf-8"))
    [linear] = [p for p in recipe["spec"]["process"] if p["type"] == "linear_quant"]
    assert recipe["default_w4a4_dynamic"]["weight"]["dtype"] == "mxfp4"
    assert QWEN_DEFAULT.bf16 == tuple(linear["exclude"])
    assert QWEN_RECIPE in QWEN_DEFAULT.source


def test_default_routes_only_the_layers_it_names():
    w4a4 = LayerRoute(Precision.W4A4, (), "W4A4", "transformer_blocks.3.txt_mlp.net.2")
    kept = QWEN_DEFAULT.route(w4a4)
    assert (
        kept.precision is Precision.BF16 and "msModelSlim" in kept.reason and "ignored_layers" in kept.reason
    )
    for name in ("transformer_blocks.3.img_mlp.net.2", "transformer_blocks.3.txt_mlp.net.0"):
        route = LayerRoute(Precision.W4A4, (), "W4A4", name)
        assert QWEN_DEFAULT.route(route) is route


def test_every_default_names_a_transformer_that_takes_a_quant_config():
    takes = {t.key for t in scanned() if t.takes_quant_config}
    assert set(FAMILY_DEFAULTS) <= takes


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_qwen_build_keeps_txt_mlp_down_projection_bf16_and_logs_it(vllm_env, caplog, method):
    spec = {"quant_method": method, "num_bf16_fallback_layers": 0} if method == "mxfp4_dualscale" else method
    with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4"):
        model = build(vllm_env, QWEN_IMAGE, spec)
    methods = _methods(model)
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    for block in (0, 1):
        kept = methods[f"transformer_blocks.{block}.txt_mlp.net.2"]
        assert not isinstance(kept, MxLinearMethod) and "msModelSlim" in kept.route.reason
        assert isinstance(methods[f"transformer_blocks.{block}.img_mlp.net.2"], MxLinearMethod)
        assert isinstance(methods[f"transformer_blocks.{block}.attn.to_qkv"], MxLinearMethod)
    logged = [r.getMessage() for r in caplog.records if "QwenImageTransformer2DModel" in r.getMessage()]
    assert logged and "*txt_mlp.net.2*" in logged[0] and "ignored_layers" in logged[0], logged


def test_user_ignored_layers_replace_the_default(vllm_env):
    # img_mod.1 is BF16 anyway (vLLM-Omni builds it without a quantization config): listing it
    # only says "no default"
    spec = {"quant_method": "mxfp4", "ignored_layers": ["transformer_blocks.0.img_mod.1"]}
    methods = _methods(build(vllm_env, QWEN_IMAGE, spec))
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    assert isinstance(methods["transformer_blocks.0.txt_mlp.net.2"], MxLinearMethod)
    assert isinstance(methods["transformer_blocks.1.txt_mlp.net.2"], MxLinearMethod)


def test_offline_configs_get_no_default(vllm_env):
    from vllm_omni_mxfp4.omni import build_quant_config
    from vllm_omni_mxfp4.omni.routes import with_family_default

    offline = build_quant_config({"quant_method": "mxfp4", "is_checkpoint_mxfp4_serialized": True})
    assert with_family_default(offline, QWEN_DEFAULT) is offline
    online = build_quant_config("mxfp4")
    applied = with_family_default(online, QWEN_DEFAULT)
    assert applied is not online and applied.overrides == (QWEN_DEFAULT,) and online.overrides == ()
