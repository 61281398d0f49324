"""``vllm-omni-mxfp4 compare``: one model under BF16 and several quantization configs, side by side.

- :mod:`.run`: one ``Omni(...)`` engine per config on the same prompts and seeds, each denoising
  step's latents recorded (:mod:`vllm_omni_mxfp4.hooks.trajectory`);
- :mod:`.metrics`: PSNR, SSIM and cosine of frames, cosine and MSE of latents (numpy);
- :mod:`.report`: the numbers per step, per request and per config, ``compare.json``, ``compare.png``
  and the summary table.
"""
