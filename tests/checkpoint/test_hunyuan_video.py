"""msModelSlim's ``hunyuan_video`` adapter quantizes HunyuanVideo 1.0: it imports the original Tencent
repository (``hyvideo``), builds ``HunyuanVideoSampler`` from ``hunyuan-video-t2v-720p/transformers/
mp_rank_00_model_states.pt`` and visits its ``MMDoubleStreamBlock`` / ``MMSingleStreamBlock``s
(``msmodelslim/model/hunyuan_video/``). vLLM-Omni 0.30 serves only HunyuanVideo-1.5
(``HunyuanVideo15Transformer3DModel``, ``HunyuanVideo15Pipeline`` and its I2V pipeline), another
architecture. So the merge refuses the model type, by name and with that reason, from the CLI, the
library and ``--model-type auto`` (diffusers' ``HunyuanVideoPipeline``), and writes nothing (issue #14).
"""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_omni_mxfp4.checkpoint import MODEL_TYPES, UNSERVED_MODEL_TYPES, CheckpointError, merge
from vllm_omni_mxfp4.cli import main

from . import producer

REASON = (
    r"msModelSlim's hunyuan_video adapter quantizes HunyuanVideo 1\.0 \(the hyvideo repository's "
    r"MMDoubleStreamBlock/MMSingleStreamBlock transformer, loaded from hunyuan-video-t2v-720p\), which "
    r"vLLM-Omni does not serve; vLLM-Omni serves HunyuanVideo-1\.5 \(HunyuanVideo15Transformer3DModel\)"
)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A valid one-transformer pipeline (tiny Wan2.1) and an empty export folder: the refusal comes
    before either is read."""
    root = tmp_path_factory.mktemp("hunyuan")
    producer.build_pipeline(root / "original", transformers=("transformer",))
    (root / "export").mkdir()
    return root / "original", root / "export"


def test_the_model_type_is_refused_with_the_reason(pipeline, tmp_path):
    original, export = pipeline
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"^--model-type HunyuanVideo: {REASON}"):
        merge("HunyuanVideo", original, export, out)
    assert not out.exists()
    assert "HunyuanVideo" not in MODEL_TYPES and set(UNSERVED_MODEL_TYPES) == {"HunyuanVideo"}


def test_the_cli_refuses_it_in_one_line(pipeline, tmp_path, capsys):
    original, export = pipeline
    argv = ["merge", "--model-type", "HunyuanVideo", "--original-model", str(original)]
    argv += ["--quant-path", str(export), "--output-path", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model-type HunyuanVideo: ") and err.count("\n") == 1
    assert "HunyuanVideo15Transformer3DModel" in err and "online" in err
    assert not (tmp_path / "out").exists()


def test_auto_refuses_a_hunyuan_video_1_pipeline(pipeline, tmp_path):
    original = tmp_path / "original"
    shutil.copytree(pipeline[0], original)
    index = json.loads((original / "model_index.json").read_text())
    index["_class_name"] = "HunyuanVideoPipeline"
    (original / "model_index.json").write_text(json.dumps(index))
    message = rf"model_index\.json: pipeline class 'HunyuanVideoPipeline' \(HunyuanVideo\): {REASON}"
    with pytest.raises(CheckpointError, match=message):
        merge("auto", original, pipeline[1], tmp_path / "out")
    assert not (tmp_path / "out").exists()
