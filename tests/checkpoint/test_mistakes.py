"""The mistakes real users make with the merge, each built from a valid real msModelSlim export
(``expert_copy``) and refused with a message that names the export, tensor, file or index entry at
fault, with nothing written to the output path.

``high_noise_model`` is the unsharded export of ``transformer`` (blocks.0 kept FLOAT),
``low_noise_model`` the sharded export of ``transformer_2``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni_mxfp4 import safetensors_io
from vllm_omni_mxfp4.checkpoint import CheckpointError

from .edits import assert_refused, drop, edit, merge_t2v, replace

OPROJ = "blocks.1.self_attn.o"  # quantized (DualScale), no Smooth
_CLI_DEADLINE_S = 600  # only a merge that blocks on a FIFO reaches it


# --- swapped or duplicated experts ---------------------------------------------------------------


def test_swapped_expert_exports(expert_copy, tmp_path):
    original, quant = expert_copy
    (quant / "high_noise_model").rename(quant / "swap")
    (quant / "low_noise_model").rename(quant / "high_noise_model")
    (quant / "swap").rename(quant / "low_noise_model")
    message = (
        r"quant/high_noise_model: this export was made from transformer_2 \(.*/orig/transformer_2\), not "
        r"from transformer \(.*/orig/transformer\): its \d+ unquantized norm, modulation and embedding "
        r"tensors, compared value for value, equal transformer_2's .* the expert exports are swapped"
    )
    assert_refused(expert_copy, tmp_path, message)


def test_one_export_for_both_experts(expert_copy, tmp_path):
    original, quant = expert_copy
    shutil.rmtree(quant / "low_noise_model")
    shutil.copytree(quant / "high_noise_model", quant / "low_noise_model")
    message = (
        r"quant/low_noise_model: this export was made from transformer \(.*\), not from transformer_2 .*"
        r"or one export was given for both: transformer_2 needs the msModelSlim export of .*/orig/transformer_2"
    )
    assert_refused(expert_copy, tmp_path, message)


def test_export_of_another_model(expert_copy, tmp_path):
    message = (
        r"quant/high_noise_model: was not made from .*/orig/transformer: of its \d+ unquantized norm, "
        r"modulation and embedding tensors, compared value for value, blocks\.2\.scale_shift_table differs"
    )
    assert_refused(expert_copy, tmp_path, message, replace("blocks.2.modulation", lambda t: t * 1.5))


# --- incomplete exports ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (
            [f"{OPROJ}.{leaf}" for leaf in ("weight", "weight_scale", "weight_dual_scale", "bias")],
            rf"has no tensor of layer blocks\.1\.attn1\.to_out\.0 \(export {OPROJ}\), which the original has",
        ),
        (
            ["blocks.0.ffn.2.weight", "blocks.0.ffn.2.bias"],
            r"has no tensor of layer blocks\.0\.ffn\.net\.2 \(export blocks\.0\.ffn\.2\), which the original has",
        ),
        (
            ["blocks.0.norm3.weight", "blocks.2.self_attn.norm_q.weight"],
            r"lacks tensor blocks\.0\.norm2\.weight \(export blocks\.0\.norm3\.weight\), and 1 other tensor",
        ),
    ],
)
def test_export_that_lacks_what_the_original_has(expert_copy, tmp_path, names, message):
    assert_refused(expert_copy, tmp_path, rf"quant_model_description.*\.json: {message}", drop(*names))


def test_quantized_layer_the_description_declares_but_no_weight_file_holds(expert_copy, tmp_path):
    def drop_tensors_only(tensors, entries):
        for leaf in ("weight", "weight_scale", "weight_dual_scale", "bias"):
            del tensors[f"{OPROJ}.{leaf}"]
        assert entries[f"{OPROJ}.weight"] == "W4A4_MXFP4_DUALSCALE"

    message = rf"describes tensor '{OPROJ}\.(weight|weight_scale|weight_dual_scale|bias)', which no weight file holds"
    assert_refused(expert_copy, tmp_path, message, drop_tensors_only)


# --- values and dtypes of every tensor -------------------------------------------------------------


def _poison(index: tuple[int, ...], value: float):
    def poison(t):
        t = t.clone()
        t[index] = value
        return t

    return poison


@pytest.mark.parametrize(
    ("name", "index", "value"),
    [
        ("blocks.0.norm3.weight", (7,), math.nan),  # a norm
        ("blocks.0.norm3.bias", (0,), -math.inf),
        ("blocks.2.modulation", (0, 3, 100), math.inf),  # a modulation table
        ("blocks.0.ffn.2.weight", (5, 77), math.nan),  # the weight of a Linear kept in BF16
        ("blocks.0.ffn.2.bias", (2,), math.inf),
        ("patch_embedding.weight", (3, 1, 0, 1, 0), math.nan),  # a Conv3d
        ("text_embedding.0.weight", (4, 9), math.inf),  # an embedder
    ],
)
def test_nan_or_inf_in_any_unquantized_tensor(expert_copy, tmp_path, name, index, value):
    shown = "nan" if math.isnan(value) else str(value)
    message = (
        rf"FLOAT tensor '{name}' holds {shown} at \[{', '.join(map(str, index))}\]; expected finite values"
    )
    assert_refused(expert_copy, tmp_path, message, replace(name, _poison(index, value)))


def test_values_are_streamed_in_chunks(expert_copy, tmp_path, monkeypatch):
    # 64-byte chunks: the bad value is found far past the first chunk, at its right index.
    monkeypatch.setattr(safetensors_io, "COPY_CHUNK", 64)
    message = r"FLOAT tensor 'blocks\.0\.ffn\.2\.weight' holds nan at \[301, 17\]"
    assert_refused(
        expert_copy, tmp_path, message, replace("blocks.0.ffn.2.weight", _poison((301, 17), math.nan))
    )


def test_unquantized_tensor_in_another_dtype_with_other_values(expert_copy, tmp_path):
    message = (
        r"FLOAT tensor 'blocks\.0\.norm3\.weight' has dtype F32, but the original blocks\.0\.norm2\.weight is "
        r"BF16, and the values differ \(at \[0\]: .* in the export, .* in the original\)"
    )
    assert_refused(
        expert_copy, tmp_path, message, replace("blocks.0.norm3.weight", lambda t: t.float() * (1 + 2**-12))
    )


def test_a_lossless_dtype_difference_keeps_the_original_tensor(expert_copy, tmp_path):
    original, quant = expert_copy
    edit(quant / "high_noise_model", replace("blocks.0.norm3.weight", lambda t: t.float()))  # export: F32
    path = original / "transformer_2" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    state["blocks.0.norm2.weight"] = state["blocks.0.norm2.weight"].float()  # original: F32
    save_file(state, str(path), metadata={"format": "pt"})
    out = tmp_path / "out"
    merge_t2v(original, quant, out)
    for folder, dtype in (("transformer", torch.bfloat16), ("transformer_2", torch.float32)):
        written = load_file(str(out / folder / "diffusion_pytorch_model.safetensors"))[
            "blocks.0.norm2.weight"
        ]
        source = load_file(str(original / folder / "diffusion_pytorch_model.safetensors"))[
            "blocks.0.norm2.weight"
        ]
        assert written.dtype == dtype and torch.equal(written, source)


# --- files that must not be opened -----------------------------------------------------------------


def _cli_refuses(original: Path, quant: Path, out: Path, message: str) -> None:
    """The CLI (in a child, so that a read of a FIFO would hang it, not the suite) exits 2 with ``message``."""
    argv = ["merge", "--model-type", "Wan2.2-T2V-A14B", "--original-model", str(original)]
    argv += ["--quant-path", str(quant), "--output-path", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "vllm_omni_mxfp4.cli", *argv],
        capture_output=True,
        text=True,
        timeout=_CLI_DEADLINE_S,
        env={**os.environ},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if "mxfp4-merge" in p.name]


def test_index_entry_that_leaves_the_export_directory(expert_copy, tmp_path):
    original, quant = expert_copy
    os.mkfifo(quant / "trap.safetensors")  # opening it would block: the entry is refused unopened
    index_path = quant / "low_noise_model" / "quant_model_weight.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "../trap.safetensors"
    index_path.write_text(json.dumps(index))
    message = (
        rf"low_noise_model/quant_model_weight\.safetensors\.index\.json: the index entry for tensor '{name}' "
        r"names shard '\.\./trap\.safetensors', which is outside .*low_noise_model; an index may only name"
    )
    _cli_refuses(original, quant, tmp_path / "out", message)


def test_original_index_entry_that_leaves_the_transformer_directory(expert_copy, tmp_path):
    original, quant = expert_copy
    names = list(load_file(str(original / "transformer" / "diffusion_pytorch_model.safetensors")))
    index = {"weight_map": dict.fromkeys(names, "/dev/zero")}
    (original / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps(index)
    )
    message = r"transformer/diffusion_pytorch_model\.safetensors\.index\.json: the index entry for tensor '.*' names shard '/dev/zero', which is outside"
    _cli_refuses(original, quant, tmp_path / "out", message)


def test_index_entry_that_names_a_fifo(expert_copy, tmp_path):
    original, quant = expert_copy
    shard = sorted((quant / "low_noise_model").glob("quant_model_weight-*.safetensors"))[-1]
    shard.unlink()
    os.mkfifo(shard)
    message = (
        rf"index\.json: the index entry for tensor '.*' names shard '{shard.name}': .*{shard.name}, which is a "
        r"FIFO \(named pipe\), not a regular file; refusing to read it"
    )
    _cli_refuses(original, quant, tmp_path / "out", message)


@pytest.mark.parametrize("kind", ["fifo", "device", "extra"])
def test_special_files(expert_copy, tmp_path, kind):
    original, quant = expert_copy
    if kind == "extra":  # a file of the transformer's directory that the merge copies
        (original / "transformer" / "notes").mkdir()
        target = original / "transformer" / "notes" / "pipe"
        os.mkfifo(target)
        message = r"transformer/notes/pipe: is a FIFO \(named pipe\), not a regular file"
    elif kind == "fifo":
        target = quant / "high_noise_model" / "quant_model_description_w4a4_mxfp4_dualscale.json"
        target.unlink()
        os.mkfifo(target)
        message = rf"{target.name}: is a FIFO \(named pipe\), not a regular file; refusing to read it"
    else:
        target = original / "vae" / "diffusion_pytorch_model.safetensors"
        target.unlink()
        target.symlink_to("/dev/zero")
        message = r"vae/diffusion_pytorch_model\.safetensors: is a character device, not a regular file"
    _cli_refuses(original, quant, tmp_path / "out", message)


# --- an already-quantized original ------------------------------------------------------------------


def test_already_quantized_original_is_reported_first(expert_copy, tmp_path, merged_dual):
    original, quant = expert_copy
    merged, _ = merged_dual
    shutil.rmtree(original / "transformer_2")
    shutil.copytree(merged / "transformer_2", original / "transformer_2")
    # The first expert's export has a shape error, which the merge would otherwise report first.
    edit(quant / "high_noise_model", replace(f"{OPROJ}.weight_scale", lambda t: t[:, :-1]))
    assert_refused(expert_copy, tmp_path, r"transformer_2/config\.json: already has a quantization_config")

    config_path = original / "transformer_2" / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]
    config_path.write_text(json.dumps(config))
    message = (
        r"transformer_2/diffusion_pytorch_model\.safetensors: original tensor '.*' \((U8|F32)\) is a quantized "
        r"checkpoint's tensor; the original is already quantized: --original-model must be the BF16 original"
    )
    assert_refused(expert_copy, tmp_path, message)


def test_merged_output_as_original(tmp_path, dual_export, merged_dual):
    merged, _ = merged_dual
    with pytest.raises(
        CheckpointError, match=r"/transformer/config\.json: already has a quantization_config"
    ):
        merge_t2v(merged, dual_export.quant, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
