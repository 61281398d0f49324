"""Every tensor a quantized Linear holds is one vLLM-Omni's offloaders and sleep mode move.

What vLLM-Omni 0.30 moves (read in ``vllm_omni/diffusion/offloader/`` and ``diffusion/worker/``):

- ``--enable-cpu-offload`` (``sequential_backend.SequentialOffloadHook._move_params``): for every
  tensor of ``module.parameters()`` and ``module.buffers()`` (recursive, each object once), a
  ``.data`` swap, ``t.data = t.data.to(device)`` (pinned when going to the host). The tensor
  objects stay; only what they point at changes (so does the backend's rollback,
  ``_restore_tensor_devices``). ``ModelLevelOffloadBackend.enable``, ``component_utils`` and the
  diffusion loader (``model.to("cpu")`` after quantizing on the device for CPU offload, which our
  configs get offline too: they set neither ``is_checkpoint_quantized`` nor ``data_type``;
  ``module.to(target_device)`` around ``process_weights_after_loading``) use ``module.to()``:
  ``nn.Module._apply`` swaps each parameter's ``.data`` in place but puts a NEW tensor object in
  ``_buffers`` for every buffer.
- ``--enable-layerwise-offload`` (``layerwise_backend.LayerwiseOffloadHook``): when the hook is
  installed it snapshots ``dict(block.named_parameters())`` and ``dict(block.named_buffers())``
  (recursive, duplicates by identity dropped; tensors registered later are never moved), copies
  them per dtype into one flat host tensor (``flatten_physical_storage`` keeps strides) and frees
  the device copies by pointing every one at a zero-element placeholder
  (``tensor_utils.clear_tensor_storage``: ``.data = torch.empty((0,))``). Before a block runs,
  ``prefetch_layer`` copies the flat host tensors into fresh device tensors and points each named
  tensor at its slice (``set_tensor_storage``: ``.data = torch.as_strided(...)``); after it runs,
  ``offload_layer`` puts the placeholders back; ``restore_next_block`` (disable) gives each tensor
  its own copy again. Two registered tensors sharing one storage get two separate copies.
  ``move_non_block_state_to_device`` moves what lies outside the blocks by ``.data`` too.
- ``--enable-sleep-mode`` (``DiffusionWorker.sleep`` / ``wake_up`` with vLLM's ``CuMemAllocator``,
  CUDA only): every allocation made while the model loads (inside ``use_memory_pool(tag="weights")``,
  which includes ``process_weights_after_loading`` and so every prepared tensor and the emulated
  kernel's dequantized weight, built when the layer is prepared) is copied to the host byte for byte
  (level 1) or discarded (level 2) and mapped again at the same address on wake: no tensor object or
  pointer changes. Memory allocated after loading (a cache filled at the first forward) lies outside
  the pool and is neither released nor backed up. Level 2 also saves ``pipeline.named_buffers()`` by
  name and copies them back (``buffer.data.copy_``); parameters stay discarded (``wake_up``
  reloads none), which no layer can repair.

So a tensor the forward reads must be a registered parameter or buffer of the layer (the prepared
tensors: non-persistent buffers of the ``_mx_prepared`` child module), and any other reference to
it must be the very Parameter object (buffers are replaced by ``module.to()``; a view or alias
sharing storage stays on the old memory after a ``.data`` swap). Nothing may be allocated lazily
at the first forward (sleep mode would not see it).

This machine has no accelerator and no pinned memory, so the movers' device transfers cannot run.
The tests drive vLLM-Omni's own layerwise hook (``apply_block_hook`` on a ring of one block, with
a host stand-in for the platform's stream API; ``pin_memory=False``), and reproduce the sequential
hook's ``.data`` swap and ``module.to()``'s ``_apply`` with a copy standing in for the transfer.
After each move the memory the layer used before is overwritten with 0xFF bytes (NaN in every float
dtype, the E8M0 NaN scale, E2M1 -6), as reused device memory would be: a tensor still reading it
changes the output, which must stay bit-identical. Sleep mode's byte-level remap cannot run here;
what it relies on (nothing allocated after loading) is checked directly.

Found while writing these tests (the cases are marked where they run):

- The NPU dual-level kernel adopts a FRACTAL_NZ weight (``NpuDual``, ``Prepared.adopt_weight``).
  torch_npu copies an NZ tensor to the host in the ND layout and to the device into a fresh ND
  tensor, so every mover above hands ``npu_dual_level_quant_matmul`` an ND weight afterwards; the
  torch_npu fake, which tags NZ tensors by storage, refuses it (strict xfail, ``NZ_LOST``).
- The ROCm kernel's adopted weight is two registered tensors on one storage (the ``weight``
  parameter, uint8, and the prepared buffer ``weight``, its float4 view): every mover splits them,
  so after the first move the layer holds its weight bytes twice. Outputs stay right (asserted
  here); the memory is not.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain

import pytest
import torch

from tests.support.fake_torch_npu import FakeNpuError
from tests.support.layers import K, N, build, env_vars, finish, load, make_layer, run, smooth_vector, weights
from tests.support.nvfp4.checkpoints import build_via_pipeline, model_dir_with
from vllm_omni_mxfp4.formats import quantize_dualscale, quantize_mx, quantize_mxfp8
from vllm_omni_mxfp4.omni.linear import MxLinearMethod
from vllm_omni_mxfp4.steps import denoise_step

from .conftest import install_aiter

pytestmark = pytest.mark.omni

EMULATED = {"method": "mxfp4", "backend": "emulated"}
OFFLINE = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "require_smooth_scale": True}
DUAL_OFFLINE = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True}
K_DUAL = 1024  # whole 512-chunks: the NPU dual-level kernel adopts the weight (no padding)
LATE_BLOCK = "blocks.7.ffn.net_2"  # past num_bf16_fallback_layers (5): DualScale quantizes it


# ----------------------------------------------------------------------------------- the layers


@dataclass
class Case:
    """A loaded, prepared quantized Linear and how to run it: once per denoising step in ``steps``
    (None: outside a denoising loop), so that every precision the layer has is exercised."""

    layer: torch.nn.Module
    x: torch.Tensor
    steps: tuple[int | None, ...] = (None,)

    def outputs(self, env) -> list[torch.Tensor]:
        outs = []
        for step in self.steps:
            with denoise_step(step) if step is not None else contextlib.nullcontext():
                out = run(env, self.layer, self.x)
            outs.append(out[0] if isinstance(out, tuple) else out)  # vLLM's (output, bias) form
        return outs


def online(env, spec, *, seed=0, k=K, n=N, prefix="blocks.1.attn2.to_q", mirror="npu", steps=(None,)) -> Case:
    """An online layer: the BF16 weight is quantized and the layer prepared as it loads."""
    w, b, x = weights(seed, n=n, k=k)
    layer = make_layer(env, spec, k=k, n=n, prefix=prefix, mirror=mirror)
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(env, layer)
    return Case(layer, x, steps)


def offline_single(env, spec, *, seed=1, dtype=torch.bfloat16, n=N, steps=(None,)) -> Case:
    """An offline single-scale layer with a Smooth vector (``mul_scale``)."""
    w, b, x = weights(seed, n=n, dtype=dtype)
    data, scale = quantize_mx(w)
    ckpt = {"weight": data, "weight_scale": scale, "mul_scale": smooth_vector(K, seed)}
    return Case(build(env, spec, ckpt, bias=b, n=n, dtype=dtype), x, steps)


def offline_dual(env, spec, *, seed=2) -> Case:
    """An offline DualScale layer with Smooth."""
    w, b, x = weights(seed, k=K_DUAL)
    data, scale, dual = quantize_dualscale(w)
    ckpt = {
        "weight": data,
        "weight_scale": scale,
        "weight_dual_scale": dual.unsqueeze(-1),
        "mul_scale": smooth_vector(K_DUAL, seed),
    }
    return Case(build(env, spec, ckpt, bias=b, k=K_DUAL, prefix=LATE_BLOCK), x)


def mxfp8(env, backend, *, seed=3) -> Case:
    """An MXFP8 W8A8 layer (``mxfp8_layers``) of an offline ``mxfp4`` checkpoint."""
    prefix = "blocks.1.attn2.to_q"
    spec = {
        "method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "mxfp8_layers": [prefix],
        "backend": backend,
    }
    w, b, x = weights(seed)
    data, scale = quantize_mxfp8(w)
    return Case(build(env, spec, {"weight": data, "weight_scale": scale}, bias=b, prefix=prefix), x)


def nvfp4(env, expert) -> Case:
    """The fused Q/K/V Linear of vLLM-Omni's Wan2.2 expert loaded from a ModelOpt NVFP4 checkpoint:
    requantized to MXFP4 while loading, then an offline ``mxfp4`` layer."""
    layer = expert.get_submodule("blocks.0.attn1.to_qkv")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, layer.input_size_per_partition, generator=g).to(torch.bfloat16)
    return Case(layer, x)


W4A8_LAYER = {"w4a8_fallback_layers": ["blocks.1.attn2.to_q"]}
W4A8_STEPS = {"w4a8_fallback_steps": [0]}

#: Every method, layer kind and CPU-runnable kernel: id -> (needs, builder(env, extras) -> Case).
#: ``needs`` names what the builder gets in ``extras``: "npu" (the torch_npu fake installed),
#: "aiter" (the AITER fake installed), "expert" (the NVFP4 Wan expert).
CASES: dict[str, tuple[str, Callable[..., Case]]] = {
    "emulated-mxfp4-online": ("", lambda env, _: online(env, EMULATED)),
    "emulated-mxfp4-online-uncached": ("uncached", lambda env, _: online(env, EMULATED)),
    "emulated-mxfp4-online-uos": ("", lambda env, _: online(env, {**EMULATED, "mxfp4_scale_alg": 2})),
    "emulated-mxfp4-offline-smooth": (
        "",
        lambda env, _: offline_single(env, {**OFFLINE, "backend": "emulated"}),
    ),
    "emulated-mxfp4-offline-smooth-fp32": (
        "",  # float32 activations: the prepared Smooth is the mul_scale parameter's own storage
        lambda env, _: offline_single(env, {**OFFLINE, "backend": "emulated"}, dtype=torch.float32),
    ),
    "emulated-mxfp4-w4a8-layer": ("", lambda env, _: online(env, {**EMULATED, **W4A8_LAYER})),
    "emulated-mxfp4-w4a8-steps": ("", lambda env, _: online(env, {**EMULATED, **W4A8_STEPS}, steps=(0, 1))),
    "emulated-dualscale-online": (
        "",
        lambda env, _: online(
            env, {"method": "mxfp4_dualscale", "backend": "emulated"}, k=K_DUAL, prefix=LATE_BLOCK
        ),
    ),
    "emulated-dualscale-offline-smooth": (
        "",
        lambda env, _: offline_dual(env, {**DUAL_OFFLINE, "backend": "emulated"}),
    ),
    "emulated-mxfp8": ("", lambda env, _: mxfp8(env, "emulated")),
    "emulated-mxfp4-svd-rank": ("", lambda env, _: online(env, {**EMULATED, "svd_rank": 8})),
    "emulated-dualscale-svd-rank": (
        "",
        lambda env, _: online(
            env,
            {"method": "mxfp4_dualscale", "backend": "emulated", "svd_rank": 8},
            k=K_DUAL,
            prefix=LATE_BLOCK,
        ),
    ),
    "emulated-rocm-mirror": ("", lambda env, _: online(env, EMULATED, mirror="rocm:rceil")),
    "nvfp4-requantized": ("expert", lambda env, extras: nvfp4(env, extras["expert"])),
    "npu-mxfp4-online-uos": (
        "npu",
        lambda env, _: online(env, {"method": "mxfp4", "mxfp4_scale_alg": 2, "backend": "npu"}),
    ),
    "npu-mxfp4-offline-smooth": ("npu", lambda env, _: offline_single(env, {**OFFLINE, "backend": "npu"})),
    "npu-mxfp4-w4a8-steps": (
        "npu",
        lambda env, _: online(env, {"method": "mxfp4", "backend": "npu", **W4A8_STEPS}, steps=(0, 1)),
    ),
    "npu-dualscale-offline-smooth": (
        "npu",
        lambda env, _: offline_dual(env, {**DUAL_OFFLINE, "backend": "npu"}),
    ),
    "npu-mxfp8": ("npu", lambda env, _: mxfp8(env, "npu")),
    "npu-mxfp4-svd-rank": (
        "npu",
        lambda env, _: online(env, {"method": "mxfp4", "backend": "npu", "svd_rank": 8}),
    ),
    # N = 256: AITER's tiles fit, the preshuffled bytes replace the weight parameter's (adopted).
    "rocm-mxfp4-online-adopted": (
        "aiter",
        lambda env, _: online(env, {"method": "mxfp4", "backend": "rocm"}, n=256),
    ),
    # N = 96: padded to the tiles, the preshuffled weight is a prepared buffer of its own.
    "rocm-mxfp4-offline-smooth-padded": (
        "aiter",
        lambda env, _: offline_single(env, {**OFFLINE, "backend": "rocm"}),
    ),
}

NZ_LOST = pytest.mark.xfail(
    strict=True,
    raises=FakeNpuError,
    reason="DEFECT: the NPU dual-level kernel keeps its weight in FRACTAL_NZ (adopt_weight). torch_npu "
    "copies device->host through the ND layout and host->device into a fresh ND tensor, so after any "
    "offload move the weight reaches npu_dual_level_quant_matmul in ND; the fake refuses it.",
)
AITER_TAG = pytest.mark.skip(
    reason="the AITER fake marks preshuffled weights by a Python attribute on the tensor object; "
    "module.to() puts a new object in _buffers, which lacks it (real preshuffled bytes survive a copy)"
)


def cases(*, marks: Mapping[str, pytest.MarkDecorator] | None = None) -> list:
    """:data:`CASES` as pytest params, with ``marks`` on the named ones."""
    marks = marks or {}
    return [pytest.param(name, id=name, marks=marks.get(name, ())) for name in CASES]


@pytest.fixture(scope="module")
def nvfp4_expert(vllm_env, tmp_path_factory):
    return build_via_pipeline(vllm_env, model_dir_with(tmp_path_factory.mktemp("nvfp4"), "nvfp4"), EMULATED)


@pytest.fixture
def case(request, vllm_env, monkeypatch) -> Case:
    """The layer of case ``request.param``, loaded and prepared with what it needs (not run yet)."""
    needs, builder = CASES[request.param]
    extras = {}
    if needs == "npu":
        request.getfixturevalue("fake_npu")
    elif needs == "aiter":
        install_aiter(monkeypatch, "rceil")
    elif needs == "expert":
        extras["expert"] = request.getfixturevalue("nvfp4_expert")
    with env_vars(VLLM_OMNI_MXFP4_EMULATED_CACHE="0") if needs == "uncached" else contextlib.nullcontext():
        built = builder(vllm_env, extras)
    assert isinstance(built.layer.quant_method, MxLinearMethod), request.param
    return built


# ------------------------------------------------------------------- what the layer object holds


def _entered(obj: object) -> bool:
    """Objects whose attributes the walk follows: this package's (kernels, state, configs, closures).
    Other libraries' objects (vLLM's, the vendor fakes that record their calls) are not followed;
    the torch modules and containers that hold ours are handled by :func:`_children`."""
    module = obj.__module__ if isinstance(obj, types.FunctionType) else type(obj).__module__
    return (module or "").startswith("vllm_omni_mxfp4")


def _children(obj: object, path: str) -> Iterator[tuple[object, str]]:
    """(object, attribute path) of everything ``obj`` refers to that the walk follows.

    A module's ``_parameters`` / ``_buffers`` entries are what the movers move: only their own
    attributes (weight loaders and other closures) are followed, not the tensors again."""
    if isinstance(obj, torch.nn.Module):
        for key, value in vars(obj).items():
            if key in ("_parameters", "_buffers"):
                for name, tensor in value.items():
                    if tensor is not None:
                        yield from ((v, f"{path}.{name}.{a}") for a, v in vars(tensor).items())
            elif key == "_modules":
                yield from ((m, f"{path}.{name}") for name, m in value.items())
            else:
                yield value, f"{path}.{key}"
    elif isinstance(obj, torch.Tensor):
        yield from ((v, f"{path}.{a}") for a, v in vars(obj).items())
    elif isinstance(obj, Mapping):
        yield from ((v, f"{path}[{k!r}]") for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from ((v, f"{path}[{i}]") for i, v in enumerate(obj))
    elif isinstance(obj, types.MethodType):
        yield obj.__self__, f"{path}.__self__"
        yield obj.__func__, path
    elif isinstance(obj, types.FunctionType):
        if _entered(obj):
            cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
            yield from ((cell.cell_contents, f"{path}<{name}>") for name, cell in cells if _filled(cell))
            yield from ((v, f"{path}<default {i}>") for i, v in enumerate(obj.__defaults__ or ()))
            yield from ((v, f"{path}<{k}>") for k, v in (obj.__kwdefaults__ or {}).items())
    elif _entered(obj):
        if hasattr(obj, "__dict__"):
            yield from ((v, f"{path}.{k}") for k, v in vars(obj).items())
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                yield getattr(obj, slot), f"{path}.{slot}"


def _filled(cell: types.CellType) -> bool:
    """Whether a closure variable has been assigned (reading an empty cell raises)."""
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def held_tensors(root: object, name: str = "layer") -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``root``'s object graph other than through a module's
    ``_parameters`` / ``_buffers`` (module ``__dict__``, state objects such as ``layer._mx``,
    dataclass fields, containers, kernel objects, closures), with its attribute path."""
    found, seen = [], set()
    stack: list[tuple[object, str]] = [(root, name)]
    while stack:
        obj, path = stack.pop()
        if (
            obj is None
            or id(obj) in seen
            or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType))
        ):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
        stack.extend(_children(obj, path))
    return found


def registered(root: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``root``'s parameters and buffers, recursively, each name once (duplicates by identity kept)."""
    return [
        *root.named_parameters(remove_duplicate=False),
        *root.named_buffers(remove_duplicate=False),
    ]


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def unmoved(root: torch.nn.Module) -> list[str]:
    """One line for every tensor ``root`` holds that the movers leave behind (see the module)."""
    params = {id(t): n for n, t in root.named_parameters(remove_duplicate=False)}
    buffers = {id(t): n for n, t in root.named_buffers(remove_duplicate=False)}
    by_storage: dict[tuple, list[str]] = {}
    for n, t in registered(root):
        if t.numel() and not t.is_meta:
            by_storage.setdefault(_storage(t), []).append(n)
    problems = []
    for path, t in held_tensors(root):
        if id(t) in params or not t.numel() or t.is_meta:
            continue  # the Parameter object itself follows every .data swap; no memory to move
        what = f"{path}: {t.dtype} {tuple(t.shape)} on {t.device}"
        if id(t) in buffers:
            problems.append(
                f"{what} is buffer {buffers[id(t)]!r} held in a plain attribute too: module.to() puts a "
                "new tensor in _buffers and this reference keeps the old one"
            )
        elif _storage(t) in by_storage:
            names = by_storage[_storage(t)]
            problems.append(
                f"{what} shares storage with {names} but is another tensor: the movers swap {names}' "
                "storage and this one keeps reading the old memory"
            )
        else:
            problems.append(f"{what} shares storage with no parameter or buffer: no mover moves it")
    return problems


@pytest.mark.parametrize("case", cases(), indirect=True)
def test_every_tensor_the_layer_holds_is_a_parameter_or_buffer(vllm_env, case):
    case.outputs(vllm_env)  # whatever a forward fills is there to be found
    problems = unmoved(case.layer)
    assert not problems, "tensors offload and sleep mode leave behind:\n" + "\n".join(problems)


def test_the_walk_sees_tensors_in_state_objects_closures_and_plain_attributes(vllm_env):
    """The check itself: each way of holding a tensor outside the registries is named by its path."""
    built = online(vllm_env, EMULATED)
    layer = built.layer
    prepared = layer._mx_prepared
    layer._mx.cache = {"w": [prepared.dequantized[:2]]}  # a view of a buffer in a state object
    layer.plain = torch.ones(3)  # a tensor no mover sees
    layer.alias = prepared.dequantized  # the buffer object itself, in a plain attribute
    layer._mx.kept = layer.weight  # the Parameter object itself: follows every .data swap
    problems = unmoved(layer)
    assert len(problems) == 3, problems
    assert any(
        p.startswith("layer._mx.cache['w'][0]: ") and "shares storage with ['_mx_prepared.dequantized']" in p
        for p in problems
    )
    assert any(p.startswith("layer.plain: torch.float32 (3,)") and "no mover moves it" in p for p in problems)
    assert any(
        p.startswith("layer.alias: ") and "is buffer '_mx_prepared.dequantized'" in p for p in problems
    )


def test_the_nvfp4_load_plan_keeps_no_tensor(nvfp4_expert):
    """The expert's NVFP4 plan (its load report) lives on the model, outside every parameter: the
    staged NVFP4 tensors must be gone once the layers are loaded."""
    from vllm_omni_mxfp4.hooks.nvfp4_loading import PLAN_ATTR

    plan = getattr(nvfp4_expert, PLAN_ATTR)
    kept = [f"{path}: {t.dtype} {tuple(t.shape)}" for path, t in held_tensors(plan, "plan") if t.numel()]
    assert plan.records and not kept, kept


# ------------------------------------------------------------------------------------ the movers


def poison(tensors: list[torch.Tensor]) -> None:
    """Overwrite the storage of ``tensors`` with 0xFF bytes, as memory reused after a move would be."""
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).fill_(0xFF)


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def storages_in_use(layer: torch.nn.Module) -> list[torch.Tensor]:
    """A reference to the storage of every parameter and buffer (kept alive to poison it later)."""
    return [t.data for t in chain(layer.parameters(), layer.buffers())]


def resident(layer: torch.nn.Module) -> list[str]:
    """Every tensor the layer still holds memory in (registered or not), by path."""
    return [
        f"{n}: {t.dtype} {tuple(t.shape)}" for n, t in [*registered(layer), *held_tensors(layer)] if t.numel()
    ]


class HostStreams:
    """vLLM-Omni's stream API as a host without an accelerator has it: one stream, and every copy
    has finished when it returns, so waiting on a stream or event and recording an event are no-ops.
    The layerwise hook asks its platform for these; the tensor moves it makes are its own."""

    class Stream:
        def wait_stream(self, other: object) -> None: ...

        def wait_event(self, event: object) -> None: ...

    class Event:
        def record(self, stream: object = None) -> None: ...

    def __init__(self) -> None:
        self._stream = self.Stream()

    def current_stream(self) -> Stream:
        return self._stream

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        yield


@pytest.fixture
def host_streams(monkeypatch):
    """The layerwise hook's platform (and ``tensor_utils``' lazy import of it) on the host."""
    import vllm_omni.platforms
    from vllm_omni.diffusion.offloader import layerwise_backend

    streams = HostStreams()
    monkeypatch.setattr(layerwise_backend, "current_omni_platform", streams)
    monkeypatch.setattr(vllm_omni.platforms, "current_omni_platform", streams, raising=False)
    return streams


@pytest.mark.parametrize("case", cases(marks={"npu-dualscale-offline-smooth": NZ_LOST}), indirect=True)
def test_layerwise_offload_round_trip_is_bit_identical(vllm_env, case, host_streams):
    """vLLM-Omni's LayerwiseOffloadHook on the layer (a ring of one block: each forward prefetches
    it, runs it and frees it again), then disabled."""
    from vllm_omni.diffusion.offloader.layerwise_backend import apply_block_hook, remove_block_hook

    layer, want = case.layer, case.outputs(vllm_env)
    checkpoint = saved_state(layer)
    before = storages_in_use(layer)
    hook = apply_block_hook(layer, layer, torch.device("cpu"), pin_memory=False)
    try:
        assert not resident(layer), (
            f"still holding memory after the hook offloaded the layer: {resident(layer)}"
        )
        poison(before)
        for _ in range(2):
            assert_same(case.outputs(vllm_env), want)
            assert not resident(layer), f"still holding memory after the forward: {resident(layer)}"
    finally:
        hook.restore_next_block()
        remove_block_hook(layer)
    assert_same(case.outputs(vllm_env), want)
    assert_state_dict_equal(layer.state_dict(), checkpoint)


@pytest.mark.parametrize("case", cases(marks={"npu-dualscale-offline-smooth": NZ_LOST}), indirect=True)
def test_cpu_offload_data_swaps_round_trip_is_bit_identical(vllm_env, case):
    """SequentialOffloadHook._move_params to the host and back: ``t.data = t.data.to(device)`` for
    every parameter and buffer (a copy stands in for each transfer)."""
    layer, want = case.layer, case.outputs(vllm_env)
    checkpoint = saved_state(layer)
    for _ in ("to the host", "back to the device"):
        before = storages_in_use(layer)
        for t in chain(layer.parameters(), layer.buffers()):
            t.data = t.data.clone()
        poison(before)
    assert_same(case.outputs(vllm_env), want)
    assert_state_dict_equal(layer.state_dict(), checkpoint)


@pytest.mark.parametrize(
    "case",
    cases(
        marks={
            "npu-dualscale-offline-smooth": NZ_LOST,
            "rocm-mxfp4-online-adopted": AITER_TAG,
            "rocm-mxfp4-offline-smooth-padded": AITER_TAG,
        }
    ),
    indirect=True,
)
def test_module_to_round_trip_is_bit_identical(vllm_env, case):
    """``module.to(device)`` and back (what the loader and the model-level backend call):
    ``nn.Module._apply`` with a copy standing in for each transfer; buffers become new objects."""
    layer, want = case.layer, case.outputs(vllm_env)
    checkpoint = saved_state(layer)
    for _ in ("to the host", "back to the device"):
        before = storages_in_use(layer)
        layer._apply(lambda t: t.clone())
        poison(before)
    assert_same(case.outputs(vllm_env), want)
    assert_state_dict_equal(layer.state_dict(), checkpoint)


def saved_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``layer.state_dict()`` (whose tensors share the parameters' storage)."""
    return {name: t.clone() for name, t in layer.state_dict().items()}


def assert_state_dict_equal(got: dict, want: dict) -> None:
    """The checkpoint tensors survive the move (kernel layouts convert back on save)."""
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


@pytest.mark.parametrize("case", cases(), indirect=True)
def test_nothing_is_allocated_by_a_forward(vllm_env, case):
    """Sleep mode backs up what was allocated while the model loaded: every tensor the layer holds
    exists, at the same address, before its first forward and after forwards at every precision."""

    def snapshot() -> dict[str, tuple]:
        tensors = [*registered(case.layer), *held_tensors(case.layer)]
        return {n: (t.dtype, tuple(t.shape), _storage(t)) for n, t in tensors if t.numel()}

    first = snapshot()
    case.outputs(vllm_env)
    case.outputs(vllm_env)
    assert snapshot() == first
