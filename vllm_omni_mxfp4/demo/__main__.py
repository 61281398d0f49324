"""``python -m vllm_omni_mxfp4.demo``: the quantized video demo (see :mod:`vllm_omni_mxfp4.demo.run`)."""

from vllm_omni_mxfp4.demo.run import main

if __name__ == "__main__":
    raise SystemExit(main())
