"""The embedded tiny Wan2.2 model and the quantized video demo (``python -m vllm_omni_mxfp4.demo``).

- :mod:`.tiny_wan`: ``build_tiny_wan()``, the cached tiny two-expert Wan2.2 diffusers pipeline;
- :mod:`.msmodelslim_export`: real msModelSlim exports of a diffusers Wan2.2 pipeline, on CPU;
- :mod:`.run`: the demo's command line (``build_parser()``, ``main()``);
- :mod:`.engine_job`: one demo mode in its own process;
- :mod:`.engine_report`: what a running ``Omni`` engine holds per transformer (a vLLM worker extension);
- :mod:`.media`, :mod:`.metrics`: videos, frame strips, PSNR and cosine similarity.

Importing this package imports nothing heavy; vLLM-Omni and msModelSlim are imported when used.
"""
