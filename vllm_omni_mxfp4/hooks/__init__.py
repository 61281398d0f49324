"""The hooks into vLLM-Omni: what this package changes where vLLM-Omni builds and loads a model.

Each hooked vLLM-Omni attribute is wrapped once (:mod:`.patching`), by one of these modules:

- :mod:`.build`: ``initialize_model`` and the Wan2.2 pipelines' ``_create_transformer`` (NVFP4
  plans, layer-name checks for every family, expert checks, the deployment features
  :mod:`.deployment` refuses);
- :mod:`.names`: vLLM-Omni's per-component config handling (Wan expert keys, the factory's
  per-component test);
- :mod:`.defaults`: the constructors of the classes with a family BF16 default;
- :mod:`.nvfp4_loading`: ``TransformerConfig.from_dict`` (NVFP4 producer configs) and the
  requantization of an NVFP4 checkpoint's tensors in the weight stream;
- :mod:`.load_guard`: the pipeline loader's ``load_weights`` (failures named, unknown tensors refused);
- :mod:`.text_encoders`: ``recursive_replace_linear`` (Hugging Face text encoders stay BF16);
- :mod:`.trajectory`: the pipelines' ``scheduler_step_maybe_with_cfg`` (each step's latents saved
  while ``VLLM_OMNI_MXFP4_TRAJECTORY_DIR`` is set, for ``compare``).

:func:`install` installs them all; :func:`vllm_omni_mxfp4.plugin.register` calls it in every
vLLM-Omni process. Importing this package installs nothing.
"""

from __future__ import annotations


def install() -> None:
    """Install every hook of this package into vLLM-Omni; idempotent."""
    from . import build, defaults, load_guard, names, nvfp4_loading, text_encoders, trajectory

    build.install()
    names.install()
    defaults.install()  # BF16 layers of published MXFP4 recipes, when no ignored_layers is given
    load_guard.install()  # names the tensor when vLLM's loaders fail; refuses unknown quantized tensors
    nvfp4_loading.install()  # NVFP4 producer configs vLLM-Omni cannot build
    text_encoders.install()  # Hugging Face text encoders whose Linears vLLM-Omni rebuilds: BF16
    trajectory.install()  # each denoising step's latents, for compare (VLLM_OMNI_MXFP4_TRAJECTORY_DIR)
