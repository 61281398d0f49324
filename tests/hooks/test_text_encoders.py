"""Z-Image's text encoder, built by vLLM-Omni's ``create_transformers_model`` under our configs: its
Linears are unquantized (``omni/text_encoders.py``), so the weights vLLM's default loader copies into
the re-created parameters are what runs; without the wrapper they get our online method, which then
never sees a weight arrive."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.omni


def tiny_qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip


def linear_methods(model: torch.nn.Module) -> set[str]:
    from vllm.model_executor.layers.linear import LinearBase

    return {type(m.quant_method).__name__ for m in model.modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("spec", [{"method": "mxfp4"}, {"method": "mxfp4_dualscale"}])
def test_the_text_encoder_is_built_bf16_under_our_configs(vllm_env, spec) -> None:
    from transformers import AutoModelForCausalLM
    from vllm_omni.diffusion.models import utils
    from vllm_omni.quantization import build_quant_config

    config = build_quant_config(spec)
    vllm_env.od_config.quantization_config = config
    try:
        with vllm_env.context():
            model = utils.create_transformers_model(AutoModelForCausalLM, vllm_env.od_config, tiny_qwen3())
            assert vllm_env.od_config.quantization_config is config  # restored after the build
            unwrapped = utils.recursive_replace_linear.__wrapped__
            with torch.device("meta"):
                probe = AutoModelForCausalLM.from_config(tiny_qwen3())
            unwrapped(probe, vllm_env.od_config)
    finally:
        vllm_env.od_config.quantization_config = None
    assert linear_methods(model) == {"UnquantizedLinearMethod"}
    # what the wrapper prevents: vLLM-Omni's own function hands these Linears our method
    assert linear_methods(probe) and "UnquantizedLinearMethod" not in linear_methods(probe)
    from vllm.model_executor.layers.linear import LinearBase

    state = {k: torch.randn_like(v, device="cpu") for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # what vLLM's default loader does with these plain parameters
    with vllm_env.context(), torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.quant_method.process_weights_after_loading(module)
        out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()


def test_other_methods_are_left_as_vllm_omni_builds_them(vllm_env) -> None:
    from transformers import AutoModelForCausalLM
    from vllm_omni.diffusion.models import utils

    vllm_env.od_config.quantization_config = None
    with vllm_env.context():
        model = utils.create_transformers_model(AutoModelForCausalLM, vllm_env.od_config, tiny_qwen3())
    assert linear_methods(model) == {"UnquantizedLinearMethod"}
