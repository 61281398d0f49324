"""``vllm_omni_mxfp4.patching.wrap_once``: one wrapper per attribute, idempotent, classmethods kept."""

from __future__ import annotations

import types

import pytest

from vllm_omni_mxfp4.patching import MARKER, WRAPPED, original_of, wrap_once


def _adding(extra: int):
    def make(original):
        def wrapper(*args, **kwargs):
            return original(*args, **kwargs) + extra

        return wrapper

    return make


def test_a_function_is_wrapped_once_and_keeps_its_identity():
    module = types.ModuleType("upstream_module")

    def scale(x):
        """Upstream's docstring."""
        return 2 * x

    module.scale = scale
    assert wrap_once(module, "scale", _adding(1), "one") is True
    assert module.scale(3) == 7 and module.scale.__name__ == "scale"
    assert module.scale.__doc__ == "Upstream's docstring." and original_of(module.scale) is scale
    assert getattr(module.scale, MARKER) == "one" and WRAPPED["upstream_module.scale"] == "one"
    wrapper = module.scale
    assert wrap_once(module, "scale", _adding(1), "one") is False  # a second install changes nothing
    assert module.scale is wrapper and module.scale(3) == 7


def test_a_second_hook_on_the_same_attribute_is_refused():
    module = types.ModuleType("upstream_module")
    module.scale = lambda x: x
    wrap_once(module, "scale", _adding(1), "one")
    with pytest.raises(RuntimeError, match="already wrapped by hook 'one'; 'two' must join it"):
        wrap_once(module, "scale", _adding(2), "two")


def test_a_classmethod_stays_a_classmethod_seeing_the_subclass():
    class Base:
        factor = 2

        @classmethod
        def make(cls, x):
            return (cls.__name__, cls.factor * x)

    class Child(Base):
        factor = 3

    def make_wrapper(original):
        def wrapper(cls, x):
            name, value = original(cls, x)
            return name, value + 1

        return wrapper

    assert wrap_once(Base, "make", make_wrapper, "cls") is True
    assert isinstance(Base.__dict__["make"], classmethod)
    assert Base.make(5) == ("Base", 11) and Child.make(5) == ("Child", 16)
    assert wrap_once(Base, "make", make_wrapper, "cls") is False


def test_a_replacement_keeps_its_own_docstring():
    module = types.ModuleType("upstream_module")

    def upstream():
        """Upstream."""

    def replaced(original):
        def ours():
            """Ours: what the replacement does."""
            return "ours"

        return ours

    module.run = upstream
    wrap_once(module, "run", replaced, "replace")
    assert module.run() == "ours" and module.run.__doc__ == "Ours: what the replacement does."
    assert original_of(module.run) is upstream


def test_every_hook_of_the_plugin_wraps_distinct_attributes_once(vllm_env):
    """After the plugin (and the CPU platform's fix-ups) installed, every wrapped vLLM / vLLM-Omni
    attribute carries exactly the hook that :data:`WRAPPED` says, and installing again wraps nothing."""
    import importlib

    from vllm_omni_mxfp4 import hooks
    from vllm_omni_mxfp4.plugin import register

    register()
    before = dict(WRAPPED)
    hooks.install()
    assert before == WRAPPED
    quantization = {
        label: hook
        for label, hook in WRAPPED.items()
        if label.startswith("vllm") and not hook.startswith("cpu_")
    }
    assert len(quantization) >= 12, quantization
    for label, hook in quantization.items():
        module_name, _, attribute = label.rpartition(".")
        owner = None
        while module_name:
            try:
                owner = importlib.import_module(module_name)
                break
            except ImportError:
                module_name, _, outer = module_name.rpartition(".")
                attribute = f"{outer}.{attribute}"
        for part in attribute.split(".")[:-1]:
            owner = getattr(owner, part)
        name = attribute.rpartition(".")[2]
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        raw = raw.__func__ if isinstance(raw, classmethod) else raw
        assert getattr(raw, MARKER, None) == hook, label
