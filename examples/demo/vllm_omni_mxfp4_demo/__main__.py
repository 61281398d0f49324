"""``python -m vllm_omni_mxfp4_demo``: the quantized video demo (see :mod:`vllm_omni_mxfp4_demo.main`)."""

from vllm_omni_mxfp4_demo.main import main

if __name__ == "__main__":
    raise SystemExit(main())
