"""The NVFP4 quality stage of the demo (``vllm_omni_mxfp4_demo.nvfp4_quality``): its emulations
leave the model as they found it, and its numbers order the formats as their weight errors must."""

from __future__ import annotations

import torch

from vllm_omni_mxfp4.formats import dequantize_mx, quantize_mx


def test_an_emulated_pass_leaves_the_model_unchanged() -> None:
    from vllm_omni_mxfp4_demo import nvfp4_quality as q

    model = q.tiny_transformer()
    inputs = q._inputs(model.config)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    reference = q._run(model, inputs, None)
    emulated = q._run(model, inputs, q.emulations()["nvfp4 (native)"])
    assert not torch.equal(emulated, reference)
    assert torch.equal(q._run(model, inputs, None), reference)  # weights restored, hooks removed
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_rows_and_the_order_of_the_weight_errors() -> None:
    from vllm_omni_mxfp4_demo import nvfp4_quality as q

    rows = {r["format"]: r for r in q.measure()}
    assert list(rows) == [
        "nvfp4 (native)",
        "nvfp4->mxfp4 floor",
        "nvfp4->mxfp4 even",
        "nvfp4->mxfp4 rceil",
        "nvfp4->mxfp4 mse",
        "bf16->mxfp4",
    ]
    # E4M3 scales per 16 beat E8M0 per 32; going through NVFP4 adds its error to MXFP4's.
    assert rows["nvfp4 (native)"]["weight_rel_rms"] < rows["bf16->mxfp4"]["weight_rel_rms"]
    assert rows["bf16->mxfp4"]["weight_rel_rms"] < rows["nvfp4->mxfp4 floor"]["weight_rel_rms"]
    assert all(0.99 < r["cosine"] <= 1.0 and r["psnr_db"] > 30 for r in rows.values())
    model = q.tiny_transformer()
    direct = [
        m.weight.data
        for n, m in model.named_modules()
        if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)
    ]
    err = sum(float(((dequantize_mx(*quantize_mx(w)) - w).double() ** 2).sum()) for w in direct)
    ref = sum(float((w.double() ** 2).sum()) for w in direct)
    assert rows["bf16->mxfp4"]["weight_rel_rms"] == round((err / ref) ** 0.5, 5)
    assert len(direct) == 20
