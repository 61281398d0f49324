"""The vLLM / vLLM-Omni glue: quantization configs, Linear methods and plugin registration.

The only package of this project that imports vllm or vllm_omni.
"""
