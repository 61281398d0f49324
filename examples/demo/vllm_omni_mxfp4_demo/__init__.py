"""The quantized video demo of vllm-omni-mxfp4 and the tiny models its tests build.

A separate distribution (``vllm-omni-mxfp4-demo``, ``examples/demo/pyproject.toml``): the runtime
package ``vllm_omni_mxfp4`` ships none of this.

- :mod:`.main`: ``python -m vllm_omni_mxfp4_demo``, the demo (``scripts/demo.sh`` runs it);
- :mod:`.modes`: the modes the demo runs and its command line;
- :mod:`.offline`: the offline step, an msModelSlim export merged into a diffusers checkpoint;
- :mod:`.engine_job`: ``Omni`` once, frames saved, in a process of its own (the demo's and the
  engine tests' one engine program);
- :mod:`.runner`: bounded subprocesses whose process groups are reaped (used by the tests too);
- :mod:`.report`: the table, ``results.json`` / ``results.md``, videos and the console summary;
- :mod:`.media`, :mod:`.metrics`: frames, videos, frame strips, PSNR and cosine similarity;
- :mod:`.tiny`: the tiny two-expert Wan2.2 pipeline and msModelSlim exports of it on CPU;
- :mod:`.z_image_config`: a vLLM-Omni general plugin (entry point of this distribution) that makes
  vLLM-Omni's ``ZImagePipeline`` build its transformer from ``transformer/config.json``.

Importing this package imports nothing heavy; vLLM-Omni and msModelSlim are imported when used.
"""
