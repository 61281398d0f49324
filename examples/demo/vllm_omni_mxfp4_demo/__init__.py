"""The quantized video demo of vllm-omni-mxfp4.

A separate distribution (``vllm-omni-mxfp4-demo``, ``examples/demo/pyproject.toml``): the runtime
package ``vllm_omni_mxfp4`` ships none of this.

- :mod:`.main`: ``python -m vllm_omni_mxfp4_demo``, the demo (``scripts/demo.sh`` runs it);
- :mod:`.modes`: the modes the demo runs and its command line;
- :mod:`.trained`, :mod:`.accuracy`: the trained tiny pipelines the demo knows (told apart by their
  manifest) and their prompt-accuracy sets;
- :mod:`.offline`: the offline step, an msModelSlim export merged into a diffusers checkpoint;
- :mod:`.report`: the table, ``results.json`` / ``results.md``, videos and the console summary;
- :mod:`.media`, :mod:`.metrics`: frames, videos, frame strips, PSNR and cosine similarity;
- :mod:`.models`: the other model families end to end (``python -m vllm_omni_mxfp4_demo.models``).

The tiny models, the engine job (``Omni`` once, in a process of its own) and its runner are the
harness the demo shares with the tests: :mod:`vllm_omni_mxfp4_tiny`, in this distribution too.

Importing this package imports nothing heavy; vLLM-Omni and msModelSlim are imported when used.
"""
