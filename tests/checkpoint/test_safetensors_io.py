"""The streaming safetensors reader/writer against the safetensors library itself."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.config.keys import layer_order
from vllm_omni_mxfp4.safetensors_io import (
    CopyBytes,
    OutputTensor,
    UnpackFp4ToBf16,
    WidenToF32,
    first_nonfinite,
    open_archive,
    read_header,
    split_into_shards,
    write_checkpoint,
)

from ..formats.reference import CODE_VALUES


@pytest.fixture
def source(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "a.bias": torch.randn(7, generator=gen),
        "b.weight": torch.randint(0, 256, (9, 3), generator=gen, dtype=torch.uint8),
        "c.mul": torch.rand(6, generator=gen).to(torch.bfloat16) + 0.5,
        "d.half": torch.randn(4, generator=gen).half(),
    }
    path = tmp_path / "src.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def _outputs(refs):
    return [OutputTensor(n, r.dtype, r.shape, CopyBytes(r)) for n, r in refs.items()]


def test_reader_locates_every_tensor(source):
    path, tensors = source
    refs, metadata = read_header(path)
    assert metadata == {"format": "pt"}
    assert set(refs) == set(tensors)
    raw = path.read_bytes()
    for name, t in tensors.items():
        ref = refs[name]
        assert ref.shape == tuple(t.shape)
        assert raw[ref.offset : ref.offset + ref.nbytes] == t.contiguous().view(torch.uint8).numpy().tobytes()
    np.testing.assert_array_equal(refs["c.mul"].read_array(), tensors["c.mul"].float().numpy())


def test_written_file_loads_with_safetensors_and_keeps_bytes(source, tmp_path):
    path, tensors = source
    refs, _ = read_header(path)
    out = tmp_path / "out"
    out.mkdir()
    files = write_checkpoint(
        out, "model", split_into_shards(_outputs(refs), None, layer_order), lambda n: None
    )
    assert files == ["model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8))
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    # every tensor is aligned to its element size
    for ref in read_header(out / "model.safetensors")[0].values():
        assert ref.offset % torch.empty(0, dtype=loaded[ref.name].dtype).element_size() == 0


def test_sharded_output_has_a_consistent_index(source, tmp_path):
    path, tensors = source
    refs, _ = read_header(path)
    out = tmp_path / "out"
    out.mkdir()
    shards = split_into_shards(_outputs(refs), 60, layer_order)
    files = write_checkpoint(out, "model", shards, lambda n: None)
    assert len(shards) > 2
    assert files[-1] == "model.safetensors.index.json"
    index = json.loads((out / files[-1]).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, shard in index["weight_map"].items():
        assert shard == f"model-{files.index(shard) + 1:05d}-of-{len(shards):05d}.safetensors"
        with safe_open(str(out / shard), "pt") as fh:
            assert torch.equal(fh.get_tensor(name).view(torch.uint8), tensors[name].view(torch.uint8))
    assert open_archive([out / f for f in files[:-1]], out / files[-1]).keys() == tensors.keys()


def test_numeric_unpack_of_every_byte(tmp_path):
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    save_file({"w": packed}, str(tmp_path / "p.safetensors"))
    ref = read_header(tmp_path / "p.safetensors")[0]["w"]
    out = tmp_path / "out"
    out.mkdir()
    tensor = OutputTensor("w", "BF16", (16, 32), UnpackFp4ToBf16(ref))
    write_checkpoint(out, "m", [[tensor]], lambda n: None)
    values = load_file(str(out / "m.safetensors"))["w"]
    assert values.dtype == torch.bfloat16 and values.shape == (16, 32)
    for byte in range(256):
        row, col = divmod(byte, 16)
        low, high = values[row, 2 * col].item(), values[row, 2 * col + 1].item()
        assert (low, high) == (CODE_VALUES[byte & 0xF], CODE_VALUES[byte >> 4])
        assert np.signbit(low) == bool(byte & 0x8) and np.signbit(high) == bool(byte & 0x80)


def test_widen_to_f32_is_exact(source, tmp_path):
    path, tensors = source
    refs, _ = read_header(path)
    out = tmp_path / "out"
    out.mkdir()
    outs = [OutputTensor(n, "F32", refs[n].shape, WidenToF32(refs[n])) for n in ("c.mul", "d.half")]
    write_checkpoint(out, "m", [outs], lambda n: None)
    loaded = load_file(str(out / "m.safetensors"))
    for name in ("c.mul", "d.half"):
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensors[name].double().float())


def test_duplicate_tensor_across_files_is_an_error(tmp_path):
    save_file({"x": torch.zeros(2), "y": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"y": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"duplicate tensor 'y'.*a\.safetensors.*b\.safetensors"):
        open_archive([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])


def test_index_disagreements_are_errors(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"y": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    index = tmp_path / "i.json"
    cases = [
        ({"x": "a.safetensors"}, "'y' in b.safetensors is not listed"),
        (
            {"x": "b.safetensors", "y": "b.safetensors"},
            "lists tensor 'x' in b.safetensors, but it is stored in a",
        ),
        ({"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"}, "lists tensor 'z'"),
        ({"x": "a.safetensors", "y": "c.safetensors"}, "lists shard 'c.safetensors'"),
    ]
    for weight_map, message in cases:
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=message):
            open_archive(files, index)
    index.write_text("[]")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        open_archive(files, index)


def test_corrupt_headers_are_errors(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="shorter than 8 bytes"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_header(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(CheckpointError, match="'x' has inconsistent shape"):
        read_header(path)
    header = json.dumps(
        {
            "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(CheckpointError, match="overlap or leave gaps"):
        read_header(path)


@pytest.mark.parametrize("fast", [True, False], ids=["copy_file_range", "read-write"])
def test_file_copies_move_bounded_chunks(tmp_path, monkeypatch, fast):
    """A copied pipeline file of any size is moved chunk by chunk (one system call each), so a signal
    is handled between chunks instead of after one call that copies the whole file."""
    import os

    from vllm_omni_mxfp4 import safetensors_io
    from vllm_omni_mxfp4.publish.output import copy_file

    monkeypatch.setattr(safetensors_io, "COPY_CHUNK", 1000)
    if not fast:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    src = tmp_path / "big.bin"
    data = np.random.default_rng(0).integers(0, 256, 10_500, dtype=np.uint8).tobytes()
    src.write_bytes(data)
    steps: list[int] = []
    assert copy_file(src, tmp_path / "out" / "big.bin", steps.append) == len(data)
    assert (tmp_path / "out" / "big.bin").read_bytes() == data
    assert len(steps) == 11 and max(steps) <= 1000 and sum(steps) == len(data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_nonfinite_reads_the_exponent_bits_as_isfinite_does(tmp_path, dtype, bad):
    """The largest finite value, subnormals, -0 and 1e30-ish values pass; the first NaN/Inf is found
    at its index in the tensor's shape, with its value."""
    info = torch.finfo(dtype)
    edge = [info.max, -info.max, info.tiny / 4, -0.0, 0.0, info.smallest_normal, 3.0]
    values = torch.tensor(edge * 40, dtype=torch.float32).to(dtype).reshape(20, 14)
    path = tmp_path / "t.safetensors"
    broken = values.clone()
    broken[7, 3] = bad
    save_file({"ok": values, "bad": broken}, str(path))
    refs, _ = read_header(path)
    assert first_nonfinite(refs["ok"]) is None
    at, value = first_nonfinite(refs["bad"])
    assert at == [7, 3]
    assert (np.isnan(value) and np.isnan(bad)) or value == bad
