"""What vLLM-Omni's diffusion transformer classes do with checkpoint names, derived from the classes.

:func:`derive_names` builds a transformer class of the installed vLLM-Omni on the meta device (no
weight memory) with one of our quantization configs and feeds its own ``load_weights`` the names of
a diffusers checkpoint (:mod:`vllm_omni_mxfp4.models.build` does the build and the trace): every
name lands on the runtime parameter (and fused piece) the model's weight loader picks, through its
``packed_modules_mapping`` / stacked-params mapping and its checkpoint-name rewrites. The result is
plain data that the torch-free merge reads (:class:`vllm_omni_mxfp4.models.names.ModelNames`);
nothing here is a table per model.

Importing this package imports neither torch nor vLLM-Omni; :func:`derive_names` does.
"""

from .derive import derive_names

__all__ = ["derive_names"]
