"""Fail closed at load: bad values, and checkpoints whose config.json disagrees with their tensors.

Every bad checkpoint is built from a valid one (``offline_dirs``: offline ``mxfp4`` with Smooth on
some layers and ``mxfp4_dualscale``; ``tiny_dir``: the BF16 model) by editing one tensor or one
config key, and loaded with vLLM-Omni's own Wan2.2 transformer and loader (``build_expert``). Each
test asserts that the one error names the tensor, what the file holds and what to do.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.layers import build_expert, checkpoint_variant, offline_dirs
from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.formats import quantize_mx

__all__ = ["offline_dirs"]  # module fixtures

pytestmark = pytest.mark.omni

NAN, INF = float("nan"), float("inf")


def set_value(name, index, value):
    """A tensor edit: ``name[index] = value``."""

    def edit(tensors):
        t = tensors[name].clone()
        t[index] = value
        tensors[name] = t

    return edit


def fill(name, value):
    def edit(tensors):
        tensors[name] = torch.full_like(tensors[name], value)

    return edit


def add(name, tensor):
    def edit(tensors):
        tensors[name] = tensor

    return edit


def quant_config(value):
    """A config edit: ``quantization_config`` removed (``KeyError``) or replaced by ``value``."""

    def edit(config):
        if value is KeyError:
            del config["quantization_config"]
        else:
            config["quantization_config"] = value

    return edit


def update_quant_config(**keys):
    def edit(config):
        config["quantization_config"].update(keys)

    return edit


def assert_refused(load, fragments):
    with pytest.raises(ValueError) as info:
        load()
    message = str(info.value)
    for fragment in fragments:
        assert re.search(fragment, message), f"{fragment!r} not in: {message}"


# ------------------------------------------------------------------------------ values, offline

OFFLINE_VALUES = {
    "dual_scale_nan": (
        "mxfp4_dualscale",
        set_value("blocks.1.attn2.to_k.weight_dual_scale", (3, 0, 0), NAN),
        [
            r"^blocks\.1\.attn2\.to_k\.weight_dual_scale: 1 of 512 values break the rule 'finite_nonnegative'",
            r"the first is nan at index \[3, 0, 0\]",
            "Likely cause: a corrupt file or a calibration that diverged",
            "vllm-omni-mxfp4 merge",
        ],
    ),
    "dual_scale_inf": (
        "mxfp4_dualscale",
        set_value("blocks.0.ffn.net.2.weight_dual_scale", (7, 1, 0), INF),
        [r"^blocks\.0\.ffn\.net_2\.weight_dual_scale: 1 of", r"the first is inf at index \[7, 1, 0\]"],
    ),
    "dual_scale_negative": (
        "mxfp4_dualscale",
        set_value("blocks.1.attn2.to_out.0.weight_dual_scale", (11, 0, 0), -0.25),
        [r"^blocks\.1\.attn2\.to_out\.weight_dual_scale: ", r"the first is -0\.25 at index \[11, 0, 0\]"],
    ),
    "e8m0_all_0xfe": (
        "mxfp4",
        fill("blocks.0.attn2.to_v.weight_scale", 0xFE),
        [
            r"^blocks\.0\.attn2\.to_v\.weight_scale: 8192 of 8192 values break the rule 'e8m0'",
            r"E8M0 codes <= 253 \(0xFD\)",
            r"the first is 0xFE at index \[0, 0\]",
        ],
    ),
    "e8m0_nan_in_a_fused_piece": (
        "mxfp4",
        set_value("blocks.0.attn1.to_k.weight_scale", (2, 1), 0xFF),
        [
            r"^blocks\.0\.attn1\.to_qkv\.weight_scale \(fused piece 'k'\): 1 of",
            r"the first is 0xFF at index \[2, 1\]",
            "a NaN or Inf in the weight when it was quantized",
        ],
    ),
    "smooth_nan": (
        "mxfp4",
        set_value("blocks.1.ffn.net.2.mul_scale", 9, NAN),
        [r"^blocks\.1\.ffn\.net_2\.mul_scale: 1 of", r"nan at index \[9\]", "Smooth calibration"],
    ),
    "smooth_out_of_range": (
        "mxfp4",
        set_value("blocks.1.ffn.net.2.mul_scale", 17, 1e30),  # finite in BF16 too: every output would be Inf
        [
            r"^blocks\.1\.ffn\.net_2\.mul_scale: 1 of \d+ values break the rule 'smooth' \(finite values in "
            r"\[2\^-24, 2\^24\]",
            r"the first is 1(\.0+\d*)?e\+30 at index \[17\]",
        ],
    ),
    "smooth_out_of_range_dualscale": (
        "mxfp4_dualscale",
        set_value("blocks.1.attn2.to_q.mul_scale", 40, 1e38),  # the largest order of magnitude float32 holds
        [
            r"^blocks\.1\.attn2\.to_q\.mul_scale: 1 of \d+ values break the rule 'smooth'",
            r"the first is (9\.9\d*e\+37|1(\.0+\d*)?e\+38) at index \[40\]",
        ],
    ),
    "bias_nan": (
        "mxfp4_dualscale",
        set_value("blocks.1.attn2.to_v.bias", 5, NAN),
        [r"^blocks\.1\.attn2\.to_v\.bias: 1 of 512 values break the rule 'finite'", r"nan at index \[5\]"],
    ),
}


@pytest.mark.parametrize("case", list(OFFLINE_VALUES))
def test_bad_values_of_an_offline_checkpoint_are_refused_at_load(vllm_env, offline_dirs, tmp_path, case):
    method, edit, fragments = OFFLINE_VALUES[case]
    bad = checkpoint_variant(offline_dirs[method], tmp_path / "bad", tensors=edit)
    assert_refused(lambda: build_expert(vllm_env, bad, None), fragments)


# ------------------------------------------------------------------- values, online and BF16 layers

ONLINE_VALUES = {
    "bf16_layer_weight_inf": (
        {"method": "mxfp4", "ignored_layers": ["blocks.0.attn2.to_k"]},
        set_value("blocks.0.attn2.to_k.weight", (4, 9), INF),
        [
            r"^blocks\.0\.attn2\.to_k\.weight: 1 of 262144 values break the rule 'finite'",
            r"inf at index \[4, 9\]",
        ],
    ),
    "bf16_layer_bias_nan": (
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1},
        set_value("blocks.0.ffn.net.0.proj.bias", 3, NAN),
        [
            r"^blocks\.0\.ffn\.net_0\.proj\.bias: 1 of",
            r"nan at index \[3\]",
            "NaN or Inf in the original weights",
        ],
    ),
    "quantized_layer_weight_nan": (
        {"method": "mxfp4"},
        set_value("blocks.1.attn2.to_q.weight", (0, 31), NAN),
        [r"^blocks\.1\.attn2\.to_q\.weight: 1 of", r"nan at index \[0, 31\]"],
    ),
    "quantized_fused_piece_weight_inf": (
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
        set_value("blocks.1.attn1.to_v.weight", (8, 0), -INF),
        [r"^blocks\.1\.attn1\.to_qkv\.weight \(fused piece 'v'\): 1 of", r"-inf at index \[8, 0\]"],
    ),
}


@pytest.mark.parametrize("case", list(ONLINE_VALUES))
def test_bad_values_of_bf16_weights_are_refused_at_load(vllm_env, tiny_dir, tmp_path, case):
    config, edit, fragments = ONLINE_VALUES[case]
    bad = checkpoint_variant(tiny_dir, tmp_path / "bad", tensors=edit)
    assert_refused(lambda: build_expert(vllm_env, bad, {**config, "backend": "emulated"}), fragments)


def test_the_value_check_is_one_vectorised_pass():
    from vllm_omni_mxfp4.omni.loading import check_values

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    weight = torch.randn(1024, 512, dtype=torch.bfloat16)
    for name, t in (
        ("finite", weight),
        ("smooth", weight.abs() + 1),
        ("e8m0", quantize_mx(weight)[1]),
    ):
        with Ops() as mode:
            check_values("w", spec.VALUE_RULES[name], t)
        # one pass over the tensor (aminmax); the rule then runs on its minimum and maximum only
        assert mode.ops[0] == "aminmax.default" and "aminmax.default" not in mode.ops[1:], mode.ops
        assert "nonzero.default" not in mode.ops, mode.ops
    t = weight.clone()
    t[700, 5] = NAN
    with pytest.raises(
        ValueError, match=r"w: 1 of 524288 values break the rule 'finite'.* nan at index \[700, 5\]"
    ):
        check_values("w", spec.VALUE_RULES["finite"], t)


def test_e8m0_rule_accepts_every_code_a_quantizer_gives_finite_weights():
    rule = spec.VALUE_RULES["e8m0"]
    big = torch.tensor(
        [[torch.finfo(dtype).max] * 32 for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    )
    for scale_rule in ("floor", "uos", "even", "rceil"):
        _, codes = quantize_mx(big, scale_rule=scale_rule)
        assert int(codes.max()) <= spec.E8M0_MAX_WEIGHT_CODE, scale_rule
    codes = torch.arange(256, dtype=torch.uint8)
    assert rule.bad(codes, torch).nonzero().flatten().tolist() == [254, 255]


# ------------------------------------------------------------------ config.json against the tensors

HOLDS_PACKED = (
    r"^blocks\.\d\.[\w.]+\.weight: the checkpoint holds torch\.uint8 \(\d+, \d+\), but the model's "
)
NO_CONFIG = [
    HOLDS_PACKED + r"blocks\.\d\.[\w.]+\.weight \(UnquantizedLinearMethod\) is torch\.bfloat16",
    "no usable quantization_config",
    "Restore quantization_config",
]


def stored(method, declared, online=None):
    """The storage/config mismatch, reported before anything the online config would trip over."""
    flag = {"mxfp4": "is_checkpoint_mxfp4_serialized", "mxfp4_dualscale": "is_checkpoint_serialized"}[method]
    return [
        rf"/transformer: the checkpoint stores pre-quantized {method} weights \(\d+ scale tensors, e\.g\. "
        r"blocks\.\d\.[\w.]+\.weight_(dual_)?scale (U8|F32) \[",
        re.escape(f"but its config.json{declared}, so {online or method} would take them for BF16 weights"),
        re.escape(
            f'"quantization_config": {{"quant_method": "{method}", "{flag}": true, "ignored_layers": []}}'
        ),
        "then load without a quantization argument",
    ]


ONLINE = stored("mxfp4", "'s quantization_config is the method name 'mxfp4', which states no storage")
WRONG_METHOD = [r"declares quant_method='mxfp4' but the active quantization config is 'mxfp4_dualscale'"]

MISMATCHES = {
    "quantization_config_missing": ("mxfp4", None, {"config": quant_config(KeyError)}, NO_CONFIG),
    "quantization_config_empty": ("mxfp4", None, {"config": quant_config({})}, NO_CONFIG),
    "quantization_config_list": ("mxfp4_dualscale", None, {"config": quant_config([])}, NO_CONFIG),
    "quantization_config_string": ("mxfp4", None, {"config": quant_config("mxfp4")}, ONLINE),
    "not_serialized": (
        "mxfp4",
        None,
        {"config": update_quant_config(is_checkpoint_mxfp4_serialized=False)},
        stored("mxfp4", "'s quantization_config sets is_checkpoint_mxfp4_serialized: false"),
    ),
    # Online mxfp4_dualscale keeps its first 5 blocks in BF16, more than the tiny model has: that
    # check must not hide that the file is quantized and config.json says otherwise.
    "dualscale_forced_without_config": (
        "mxfp4_dualscale",
        "mxfp4_dualscale",
        {"config": quant_config(KeyError)},
        stored("mxfp4_dualscale", " has no quantization_config"),
    ),
    "dualscale_forced_over_a_string": (
        "mxfp4_dualscale",
        "mxfp4_dualscale",
        {"config": quant_config("mxfp4_dualscale")},
        stored(
            "mxfp4_dualscale",
            "'s quantization_config is the method name 'mxfp4_dualscale', which states no storage",
        ),
    ),
    "dualscale_forced_over_not_serialized": (
        "mxfp4_dualscale",
        "mxfp4_dualscale",
        {"config": update_quant_config(is_checkpoint_serialized=False)},
        stored("mxfp4_dualscale", "'s quantization_config sets is_checkpoint_serialized: false"),
    ),
    "other_method_forced": ("mxfp4", "mxfp4_dualscale", {}, WRONG_METHOD),
    "other_method_forced_without_config": (
        "mxfp4",
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
        {"config": quant_config(KeyError)},
        stored("mxfp4", " has no quantization_config", online="mxfp4_dualscale"),
    ),
    "online_forced_with_an_ignored_layer": (
        "mxfp4",
        {"method": "mxfp4", "ignored_layers": ["blocks.0.attn1.to_qkv"]},
        {"config": quant_config(KeyError), "tensors": lambda t: t.pop("blocks.0.attn1.to_q.mul_scale")},
        stored("mxfp4", " has no quantization_config"),
    ),
    "ignored_layer_is_quantized": (
        "mxfp4",
        None,
        {"config": update_quant_config(ignored_layers=["blocks.1.attn2.to_q"])},
        [
            r"^blocks\.1\.attn2\.to_q\.weight: the mxfp4 config keeps this Linear in BF16 \(listed in ignored_layers\)",
            r"holds torch\.uint8 \(512, 256\)",
            r"Remove 'blocks\.1\.attn2\.to_q' from ignored_layers",
        ],
    ),
    "ignored_fused_layer_is_quantized": (
        "mxfp4_dualscale",
        None,
        {"config": update_quant_config(ignored_layers=["blocks.0.attn1.to_qkv"])},
        [
            r"^blocks\.0\.attn1\.to_qkv\.weight: the mxfp4_dualscale config keeps",
            r"Remove 'blocks\.0\.attn1\.to_qkv'",
        ],
    ),
    "config_builds_fewer_blocks": (
        "mxfp4",
        None,
        {"config": lambda c: c.__setitem__("num_layers", 1)},  # vLLM-Omni would skip block 1's tensors
        [
            r"/transformer: config\.json and the weights disagree: the WanTransformer3DModel \(transformer\) "
            r"vLLM-Omni built has 1 blocks as config\.json says \(num_layers=1\), but the weights hold "
            r"blocks 0-1 \(2\)",
            "Use the config.json that belongs to these weights",
        ],
    ),
    "config_builds_more_blocks": (
        "mxfp4_dualscale",
        None,
        {"config": lambda c: c.__setitem__("num_layers", 3)},
        [r"has 3 blocks as config\.json says \(num_layers=3\), but the weights hold blocks 0-1 \(2\)"],
    ),
    "bias_wrong_length": (
        "mxfp4",
        None,
        {"tensors": add("blocks.1.attn2.to_k.bias", torch.zeros(7, dtype=torch.bfloat16))},
        [
            r"^blocks\.1\.attn2\.to_k\.bias: the checkpoint holds torch\.bfloat16 \(7,\)",
            r"blocks\.1\.attn2\.to_k\.bias \(Mxfp4LinearMethod\) is torch\.bfloat16 \(512,\)",
            "a bias of the wrong length",
        ],
    ),
    "fused_bias_wrong_length": (
        "mxfp4_dualscale",
        None,
        {"tensors": add("blocks.0.attn1.to_v.bias", torch.zeros(500, dtype=torch.bfloat16))},
        [
            r"^blocks\.0\.attn1\.to_v\.bias: the checkpoint holds torch\.bfloat16 \(500,\)",
            r"blocks\.0\.attn1\.to_qkv\.bias \(Mxfp4DualScaleLinearMethod\) is torch\.bfloat16 \(1536,\)",
        ],
    ),
    "unknown_tensor": (
        "mxfp4",
        None,
        {"tensors": add("blocks.1.attn2.to_q.input_scale", torch.ones(1))},
        [r"unknown to the model and would be ignored: \['blocks\.1\.attn2\.to_q\.input_scale'\]", "remove"],
    ),
    "unknown_tensor_in_a_fused_piece": (
        "mxfp4_dualscale",
        None,
        {"tensors": add("blocks.0.attn1.to_k.smooth_scale", torch.ones(512))},
        [r"\['blocks\.0\.attn1\.to_k\.smooth_scale'\]"],
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_config_that_disagrees_with_the_tensors_is_one_clear_error(vllm_env, offline_dirs, tmp_path, case):
    method, quantization, edits, fragments = MISMATCHES[case]
    bad = checkpoint_variant(offline_dirs[method], tmp_path / "bad", **edits)
    assert_refused(lambda: build_expert(vllm_env, bad, quantization), fragments)


def test_a_bf16_model_whose_config_builds_other_blocks_is_refused_online(vllm_env, tiny_dir, tmp_path):
    bad = checkpoint_variant(tiny_dir, tmp_path / "bad", config=lambda c: c.__setitem__("num_layers", 1))
    build_expert(vllm_env, tiny_dir, {"method": "mxfp4"})
    fragments = [
        r"config\.json and the weights disagree: .* has 1 blocks as config\.json says \(num_layers=1\)"
    ]
    assert_refused(lambda: build_expert(vllm_env, bad, {"method": "mxfp4"}), fragments)


def test_the_valid_checkpoint_still_loads_and_the_model_keeps_its_loader(vllm_env, offline_dirs):
    model = build_expert(vllm_env, offline_dirs["mxfp4"], None)
    assert "load_weights" not in vars(model)  # the guard wraps one load, then steps aside


def test_errors_raised_outside_vllm_keep_their_own_message():
    from vllm_omni_mxfp4.hooks.load_guard import guarded_load_weights

    def load_weights(weights):
        for _ in weights:
            raise RuntimeError("a kernel failed")  # not vLLM's loader: nothing to rename

    with pytest.raises(RuntimeError, match="^a kernel failed$"):
        guarded_load_weights(torch.nn.Module(), load_weights, [("blocks.0.attn2.to_q.weight", torch.ones(2))])


def test_the_copy_counter_counts_one_storage_and_refuses_a_process_without_dispatch_modes():
    from torch.utils._mode_utils import no_dispatch

    from vllm_omni_mxfp4.omni.loading import CopyCounter

    target, other = torch.zeros(4, 8), torch.zeros(4, 8)
    with CopyCounter(target) as counter:
        target[1:3].copy_(torch.ones(2, 8))
        other.copy_(torch.ones(4, 8))  # another storage: not counted
    assert counter.count == 16
    with no_dispatch(), pytest.raises(RuntimeError, match="does not run dispatch modes"), CopyCounter(target):
        target.copy_(torch.ones(4, 8))
