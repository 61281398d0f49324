"""Build, load, finish and run quantized vLLM Linears and vLLM-Omni's tiny Wan2.2 model in this process.

Everything here runs under the ``vllm_env`` fixture (``tests/conftest.py``).

``make_layer`` builds a vLLM Linear of the requested kind with a quantization spec through vLLM's
own constructors, so the method, its kernel selection and its loaders are the ones an engine uses.
``exact=True`` (the default) selects the emulated kernels' float32 GEMM
(``VLLM_OMNI_MXFP4_EMULATED_COMPUTE=float32``), whose outputs equal a float32 reference bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni_mxfp4.formats import quantize_dualscale, quantize_mx, quantize_mxfp8
from vllm_omni_mxfp4.kernels import EmulatedDual, EmulatedMxfp8, EmulatedSingle
from vllm_omni_mxfp4.omni import build_quant_config

K, N = 256, 96


@contextlib.contextmanager
def env_vars(**values: str):
    """Set environment variables for the duration of the block (kernels read them when built)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_layer(
    env,
    spec,
    kind="column",
    *,
    k=K,
    n=N,
    bias=True,
    prefix="blocks.1.attn2.to_q",
    dtype=torch.bfloat16,
    exact=True,
    mirror="npu",
):
    """A vLLM Linear (``column``, ``row``, ``replicated``) with ``spec``'s quantization method."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    cls = {"column": ColumnParallelLinear, "row": RowParallelLinear, "replicated": ReplicatedLinear}[kind]
    qc = build_quant_config(spec)
    options = {"VLLM_OMNI_MXFP4_EMULATED_MIRROR": mirror}
    if exact:
        options["VLLM_OMNI_MXFP4_EMULATED_COMPUTE"] = "float32"
    with env.context(), env_vars(**options):
        layer = cls(k, n, bias=bias, quant_config=qc, prefix=prefix, params_dtype=dtype, return_bias=False)
    return _zero_bias(layer)


def _zero_bias(layer):
    """A bias the test does not load holds zeros, not ``torch.empty`` garbage (which could be NaN and
    trip the load-time value check; vLLM-Omni's loader refuses a checkpoint that lacks a bias)."""
    if getattr(layer, "bias", None) is not None:
        layer.bias.data.zero_()
    return layer


def make_qkv(env, spec, *, prefix="blocks.0.attn1.to_qkv", bias=True):
    """A fused Q/K/V Linear (2 heads of 32 per projection, K inputs) with ``spec``'s method."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    qc = build_quant_config(spec)
    with env.context(), env_vars(VLLM_OMNI_MXFP4_EMULATED_COMPUTE="float32"):
        layer = QKVParallelLinear(
            K,
            head_size=32,
            total_num_heads=2,
            bias=bias,
            quant_config=qc,
            prefix=prefix,
            params_dtype=torch.bfloat16,
            return_bias=False,
        )
    return _zero_bias(layer)


def load(layer, name, tensor, *shard):
    """Load one checkpoint tensor (or a Q/K/V piece) through the parameter's weight loader."""
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *shard)


def finish(env, layer):
    """What vLLM-Omni's loader does after loading: ``process_weights_after_loading``."""
    with env.context():
        layer.quant_method.process_weights_after_loading(layer)


def run(env, layer, x):
    with env.context(), torch.no_grad():
        return layer(x)


def build(env, spec, ckpt, *, bias=None, **kw):
    """A Linear with ``spec``'s method, loaded with ``ckpt`` (+ ``bias``) and finished."""
    layer = make_layer(env, spec, bias=bias is not None, **kw)
    for name, tensor in ckpt.items():
        load(layer, name, tensor)
    if bias is not None:
        load(layer, "bias", bias)
    finish(env, layer)
    return layer


def weights(seed=0, n=N, k=K, dtype=torch.bfloat16):
    """A weight (N, K), a bias (N,) and activations (3, 5, K) with a wide dynamic range."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype)
    x = (torch.randn(3, 5, k, generator=g) * torch.exp(torch.randn(3, 5, k, generator=g))).to(dtype)
    return w, b, x


def outlier_weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    """A BF16 weight whose few large input channels lie in two directions: the structure that makes
    a diffusion transformer's weights hard for MXFP4, and that a low-rank branch takes out."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    columns = torch.randperm(k, generator=g)[:6]
    w[:, columns] += torch.randn(n, 2, generator=g) @ torch.randn(2, 6, generator=g)
    return w.to(torch.bfloat16)


def activations(seed: int = 1, k: int = K) -> torch.Tensor:
    """Activations (4, 7, K) in BF16, standard normal."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 7, k, generator=g).to(torch.bfloat16)


def smooth_vector(k: int, seed: int = 1) -> torch.Tensor:
    """A positive Smooth vector (K,) of moderate spread."""
    return torch.exp(0.5 * torch.randn(k, generator=torch.Generator().manual_seed(seed)))


# ----------------------------------------------------------------------------- the tiny Wan2.2 model


def build_expert(env, model_dir, spec, sub="transformer"):
    """vLLM-Omni's Wan2.2 transformer ``sub`` built by its factory, its layer names checked as the
    engine checks each component of the pipeline it builds (``vllm_omni_mxfp4.hooks.build``), and
    loaded by its own loader."""
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (
        create_transformer_from_config,
        load_transformer_config,
    )
    from vllm_omni.quantization import build_quant_config

    from vllm_omni_mxfp4.hooks.names import check_built_model

    cfg = load_transformer_config(str(model_dir), sub)
    qc = build_quant_config(spec) if spec is not None else None
    with env.context():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = create_transformer_from_config(cfg, qc, component=sub)
        finally:
            torch.set_default_dtype(old)
        check_built_model(model, sub, Path(model_dir) / sub)
        model.weights_sources = [
            DiffusersPipelineLoader.ComponentSource(
                model_or_path=str(model_dir), subfolder=sub, revision=None
            )
        ]
        loader = DiffusersPipelineLoader(LoadConfig(), env.od_config)
        loader.load_weights(model)
        loader._process_weights_after_loading(model, torch.device("cpu"))
    return model.eval()


def inputs():
    """Fixed transformer inputs of the tiny model, in bf16."""
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 16, 3, 8, 8, generator=g).to(torch.bfloat16)
    ehs = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    return hs, torch.tensor([500]), ehs


def forward(env, model):
    """One transformer forward on :func:`inputs`."""
    hs, ts, ehs = inputs()
    with env.context(), torch.no_grad():
        return model(hidden_states=hs, timestep=ts, encoder_hidden_states=ehs, return_dict=False)[0]


def quantized_layers(model):
    """The model's Linears that run our MXFP4 methods, by name."""
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    return {
        n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), MxLinearMethod)
    }


def set_kernels(model, make_kernel):
    """Prepare every quantized Linear again on ``make_kernel(format)`` (one kernel per format)."""
    kernels = {}
    for layer in quantized_layers(model).values():
        method = layer.quant_method
        kernel = kernels.setdefault(method.method_name, make_kernel(method.method_name))
        method.use_kernel(layer, kernel)


def emulated(fmt, **options):
    """An emulated kernel of format ``fmt`` with the NPU's numerics."""
    return {"mxfp4": EmulatedSingle, "mxfp8": EmulatedMxfp8}.get(fmt, EmulatedDual)(**options)


def exact(fmt):
    """An emulated kernel of ``fmt`` with float32 GEMMs (bit-exact against the reference)."""
    return emulated(fmt, compute_dtype="float32")


def write_offline_checkpoint(src, dst, method, *, smooth_layers=()):
    """An offline checkpoint written with the formats core (diffusers names, split Q/K/V)."""
    shutil.copytree(src, dst)
    path = dst / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    out = {}
    g = torch.Generator().manual_seed(1)
    quantized = set()
    for name, t in tensors.items():
        prefix = name[: -len(".weight")]
        if not (name.endswith(".weight") and name.startswith("blocks.") and t.dim() == 2):
            out[name] = t
            continue
        quantized.add(prefix)
        smooth = None
        if method == "mxfp4_dualscale" or prefix.endswith(smooth_layers):
            smooth = torch.exp(0.2 * torch.randn(t.shape[1], generator=g))
            if ".attn1.to_" in prefix:  # fused Q/K/V share one Smooth tensor
                smooth = torch.exp(0.2 * torch.randn(t.shape[1], generator=torch.Generator().manual_seed(9)))
            out[prefix + ".mul_scale"] = smooth
            t = (t.float() / smooth).to(torch.bfloat16)
        if method == "mxfp4_dualscale":
            data, scale, dual = quantize_dualscale(t)
            out[prefix + ".weight_dual_scale"] = dual.unsqueeze(-1)
        else:
            data, scale = quantize_mx(t)
        out[prefix + ".weight"] = data
        out[prefix + ".weight_scale"] = scale
    save_file(out, str(path))
    config = json.loads((dst / "config.json").read_text())
    if method == "mxfp4":
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "is_checkpoint_mxfp4_serialized": True,
            "ignored_layers": [],
            "require_smooth_scale": False,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "mxfp4_dualscale",
            "is_checkpoint_serialized": True,
            "ignored_layers": [],
        }
    (dst / "config.json").write_text(json.dumps(config))
    return quantized


@pytest.fixture(scope="module")
def offline_dirs(tiny_dir, tmp_path_factory):
    """Offline ``mxfp4`` (Smooth on some layers) and ``mxfp4_dualscale`` checkpoints of the tiny model."""
    root = tmp_path_factory.mktemp("offline")
    dirs = {}
    for method, smooth in (
        ("mxfp4", (".attn1.to_q", ".attn1.to_k", ".attn1.to_v", ".ffn.net.2")),
        ("mxfp4_dualscale", ()),
    ):
        model = root / method
        model.mkdir()
        write_offline_checkpoint(
            tiny_dir / "transformer", model / "transformer", method, smooth_layers=smooth
        )
        shutil.copy(tiny_dir / "model_index.json", model / "model_index.json")
        dirs[method] = model
    return dirs


def checkpoint_variant(src, dst, *, config=None, tensors=None, sub="transformer"):
    """A copy of the model directory ``src`` at ``dst`` with expert ``sub``'s ``config.json`` passed
    through ``config(dict)`` and its tensors through ``tensors(dict)`` (both edit in place): a bad
    checkpoint built from a valid one."""
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / sub / "config.json"
        data = json.loads(path.read_text())
        config(data)
        path.write_text(json.dumps(data))
    if tensors is not None:
        path = dst / sub / "diffusion_pytorch_model.safetensors"
        data = load_file(str(path))
        tensors(data)
        save_file(data, str(path))
    return dst


def write_mxfp8_blocks(src, dst, blocks=(0,), smooth_layers=()):
    """The tiny model's transformer ``src`` as an offline ``mxfp4`` checkpoint at ``dst`` whose
    ``blocks`` store every Linear as MXFP8 W8A8 (``float8_e4m3fn`` weights, E8M0 scales per 32,
    quantized from the original BF16 weights with the OCP rule) and list them in ``mxfp8_layers``:
    the layout msModelSlim's Wan2.2 recipes give blocks 0-4. ``smooth_layers``: diffusers-name
    suffixes of MXFP4 layers (outside ``blocks``) stored with Smooth factors. Returns the runtime
    names listed."""
    from vllm_omni_mxfp4.models.wan import runtime_layer_name

    write_offline_checkpoint(src, dst, "mxfp4", smooth_layers=smooth_layers)
    original = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    path = dst / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    listed = set()
    for name, t in original.items():
        prefix = name[: -len(".weight")]
        if (
            name.endswith(".weight")
            and f"{prefix}.weight_scale" in tensors
            and int(name.split(".")[1]) in blocks
        ):
            tensors[name], tensors[f"{prefix}.weight_scale"] = quantize_mxfp8(t)
            listed.add(runtime_layer_name(prefix))
    save_file(tensors, str(path))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["mxfp8_layers"] = sorted(listed)
    (dst / "config.json").write_text(json.dumps(config))
    return sorted(listed)


@pytest.fixture(scope="module")
def mxfp8_dir(tiny_dir, tmp_path_factory):
    """The tiny model with block 0 in MXFP8 W8A8 and block 1 in MXFP4 (one offline ``mxfp4`` checkpoint)."""
    model = tmp_path_factory.mktemp("mxfp8") / "model"
    model.mkdir()
    write_mxfp8_blocks(tiny_dir / "transformer", model / "transformer")
    shutil.copy(tiny_dir / "model_index.json", model / "model_index.json")
    return model


def initialize_pipeline(env, model_dir, spec, **od_kwargs):
    """vLLM-Omni's pipeline class for ``model_dir`` built by its own ``initialize_model`` (with this
    package's hooks, as the engine's diffusion worker builds it) with quantization ``spec`` and the
    other diffusion-config fields ``od_kwargs``; no weights are loaded."""
    from vllm_omni.diffusion import registry
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    od_config = OmniDiffusionConfig.from_kwargs(
        model=str(model_dir), dtype=torch.bfloat16, quantization_config=spec, **od_kwargs
    )
    od_config.enrich_config()
    with env.context():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return registry.initialize_model(od_config)
        finally:
            torch.set_default_dtype(old)
