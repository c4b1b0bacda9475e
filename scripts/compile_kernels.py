"""Compile every Triton kernel launch the engine makes, for sm_90, with the installed
Triton, down to a cubin, on a machine without a GPU.

Why: the platform runs the engine on Triton 3.1 (H100, sm_90); our GPU runs Triton
3.6. A kernel (or a constexpr combination of one) that only builds on the newer
Triton would pass every GPU test here and fail on the platform. CI has no GPU, so
this compiles what the engine would launch, exactly as Triton 3.1 would compile it
at the first launch, and fails naming the kernel and its specialization.

How:
  1. Capture. The engine's own code runs: fq_config.Qwen3Config.from_dir,
     fq_weights.load_weights, fq_qwen3.Qwen3Model over fq_ops.TritonOps and
     fq_decode.DecodeRunner, prefill and a decode step, over a sweep of shapes
     (GENERATE_SHAPES, DECODE_BATCHES x DECODE_CAPACITIES below), each with our
     GEMV and with cuBLAS for the decode products (the choice TritonOps.tune
     makes at warmup), for the presets in DEFAULT_MODELS. Tensors are meta tensors that report device "cuda"
     (MetaAsCuda), so nothing is allocated and the wrappers' CUDA checks pass.
     Each launch goes through Triton's own JITFunction.run, which builds the
     signature, the constexprs, the specialization (divisibility by 16, == 1,
     do_not_specialize) and the options exactly as on a GPU, with a driver stub
     that names the target (sm_90); JITFunction.cache_hook records the result
     and stops run() before it compiles or launches. A tensor argument reaches
     Triton as a stand-in whose data_ptr is its byte offset into an allocation
     aligned as torch's CUDA allocator aligns one (512 bytes), so a view's
     pointer is divisible by 16 exactly when it would be on a GPU.
  2. Compile. Each distinct specialization (Triton's own cache key) goes through
     triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) with the
     options run() parsed: the call run() makes, through ptxas to a cubin, in a
     process pool, into a fresh Triton cache directory.
  3. Coverage. Every @triton.jit function defined in engine/fqkernels/*.py must
     have been launched, or be called from another one (a device helper such as
     pdl.wait): a kernel that no scenario reaches fails the run.

The sweep runs the model at two layers (the first and the last, which differ in
prefill): every layer launches the same kernels with the same arguments, and the
cache's per-layer views are 16-byte aligned. One shape per model also runs at full
depth and must produce the same specializations (the run fails otherwise);
--full-depth runs the whole sweep at full depth.

PDL. On Triton 3.1 fqkernels/pdl.py turns dependent launch off (no launch_pdl
option), so the engine launches every kernel with PDL=False: --pdl off, the
default. --pdl on forces pdl.ENABLED (and the launch option only where this
Triton has it), which compiles the decode-sized launches with the griddepcontrol
instructions as the engine runs them on Triton 3.4+; --pdl both does both.

Usage:
    python scripts/compile_kernels.py [--target sm_90] [--models qwen3-4b tiny ...]
        [--pdl off|on|both] [--jobs N] [--json PATH] [--capture-only] [--full-depth]
Exit status: 0 every specialization compiled and every kernel was launched; 1 a
compile failed or a kernel was never launched; 2 usage, or a Triton other than 3.1
(the capture mirrors Triton 3.1's launch path).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import os
import pathlib
import pkgutil
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Callable, Iterator

import torch
import triton
from torch.overrides import TorchFunctionMode

REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE_DIR = REPO / "engine"
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))            # fastqwen, when it is not installed


def use_engine_dir(folder: pathlib.Path) -> None:
    """Import the engine from `folder` (its modules import each other by absolute name)."""
    global ENGINE_DIR
    ENGINE_DIR = pathlib.Path(folder).resolve()
    loaded = sys.modules.get("fqkernels")
    if loaded is not None and not pathlib.Path(loaded.__path__[0]).resolve().is_relative_to(ENGINE_DIR):
        raise RuntimeError(f"fqkernels is already imported from {loaded.__path__[0]}, not {ENGINE_DIR}")
    sys.path.insert(0, str(ENGINE_DIR))


use_engine_dir(ENGINE_DIR)

# The models whose launches are captured: a preset name, optionally with config.json
# fields overridden ("preset:field=value,..."). qwen3-4b is the platform's model; an
# odd sliding window covers the attention kernel's window argument when it is not a
# multiple of 16; qwen3-8b (untied LM head, default GEMV configs) is the size whose
# products take split-K through the GEMV's own reduce kernel; tiny is the CPU tests'
# model (head_dim 64).
DEFAULT_MODELS = ("qwen3-4b", "qwen3-4b:sliding_window=1000", "qwen3-8b", "tiny")

# Engine.generate shapes (batch, prompt, new tokens): the prefill, then one decode
# step (every step launches the same kernels). Shapes past the model's
# max_position_embeddings are skipped, as Engine.generate refuses them.
GENERATE_SHAPES = (
    (1, 512, 32), (4, 2048, 32), (16, 512, 128),   # the public workloads
    (1, 1, 2),           # a one-token prompt
    (3, 1000, 40),       # a prompt length that is not a multiple of 16
    (2, 16384, 8),       # one full 16,384-token prefill group
    (3, 9000, 4),        # prefill groups of fewer sequences than the batch
    (1, 20000, 4),       # a prompt longer than a group: the MLP in row slices
    (65, 64, 4),         # past the decode GEMV's and PDL's 64 rows
)
# Decode steps: every batch of 1..65 (the GEMV configs change with the row count up
# to 64, and PDL and the GEMV stop at 64) at every cache capacity the attention's
# split plan distinguishes: whole 256-position granules up to 4096 (64 splits of
# 64 positions), then two larger ones and a long-context one.
DECODE_BATCHES = tuple(range(1, 66))
DECODE_CAPACITIES = tuple(range(256, 4097, 256)) + (4352, 8192, 32768)
# The depth of the sweep's model (see the module docstring).
SWEEP_LAYERS = 2

ALLOCATION_ALIGNMENT = 512   # bytes; torch's CUDA caching allocator rounds every block to this
CUDA = torch.device("cuda", 0)


def unsupported_reason() -> str | None:
    """Why this Triton cannot be checked here, or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: the interpreter compiles nothing"
    if not triton.__version__.startswith("3.1."):
        return (f"the capture mirrors Triton 3.1's launch path (the platform's); Triton {triton.__version__} "
                f"is installed")
    return None


def parse_target(text: str):
    from triton.backends.compiler import GPUTarget

    match = re.fullmatch(r"sm_(\d+)", text)
    if not match:
        raise ValueError(f"target must look like sm_90, got {text!r}")
    return GPUTarget("cuda", int(match.group(1)), 32)


# ----------------------------------------------------------------------------- meta tensors that say "cuda"

def _names_cuda(device: object) -> bool:
    return ((isinstance(device, torch.device) and device.type == "cuda")
            or (isinstance(device, str) and device.split(":")[0] == "cuda"))


class MetaAsCuda(TorchFunctionMode):
    """Tensors made for device "cuda" are made on "meta" (shapes, strides and dtypes
    only), and meta tensors answer `.device` with cuda:0 and `.is_cuda` with True.

    FakeTensorMode cannot stand in here: it keeps a real CUDA device on the tensor,
    and Python indexing then sets that device (a CUDA call, which fails without a
    driver). Host reads of values (.item(), .tolist()) fail, as they would inside
    a CUDA graph: the model's prefill and decode make none. Pinned host buffers
    are plain ones (without a GPU there is no pinned allocator).
    """

    _DEVICE = torch.Tensor.device.__get__
    _IS_CUDA = torch.Tensor.is_cuda.__get__
    _IS_META = torch.Tensor.is_meta.__get__

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == self._DEVICE:
            device = func(*args)
            return CUDA if device.type == "meta" else device
        if func == self._IS_CUDA:
            return func(*args) or self._IS_META(args[0])
        if func is torch.Tensor.pin_memory:                        # pinned host buffers: plain ones
            return args[0]
        kwargs.pop("pin_memory", None)
        if "device" in kwargs and _names_cuda(kwargs["device"]):   # factories: torch.empty(..., device=)
            kwargs = dict(kwargs, device="meta")
        if func is torch.Tensor.to:                                # the one method taking a device positionally
            args = tuple("meta" if _names_cuda(a) else a for a in args)
        elif func is torch.Tensor.cuda:
            return args[0].to("meta")
        return func(*args, **kwargs)


class _MetaCheckpoint:
    """safetensors.safe_open over a checkpoint that holds every tensor `shapes` names, as BF16 meta tensors."""

    def __init__(self, shapes: dict):
        self.shapes = shapes

    def __call__(self, path, framework="pt", device="cpu"):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return list(self.shapes)

    def get_tensor(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], dtype=torch.bfloat16, device="meta")


# ----------------------------------------------------------------------------- capture

def _option_defaults() -> dict:
    """CUDAOptions' field defaults, less those the backend derives from the target."""
    from triton.backends.nvidia.compiler import CUDAOptions

    derived = {"extern_libs", "allow_fp8e4nv", "allow_fp8e4b15", "max_num_imprecise_acc_default"}
    return {f.name: f.default for f in dataclasses.fields(CUDAOptions) if f.name not in derived}


_OPTION_DEFAULTS = _option_defaults()


@dataclasses.dataclass(eq=False)
class Spec:
    """One specialization of one kernel: what Triton would compile at its first launch."""

    kernel: object          # the JITFunction
    key: str                # Triton's cache key for the launch (signature, specialization, constexprs, options)
    signature: dict         # non-constexpr argument -> Triton type
    constants: dict         # constexprs, and the arguments specialized to a constant (== 1, None)
    attrs: object           # AttrsDescriptor: divisible_by_16, equal_to_1 (argument indices)
    options: dict           # the backend options run() parsed (num_warps, num_stages, ...)
    scenario: str           # the first scenario that launched it
    site: str               # where the engine launched it
    launches: int = 1
    pdl: bool = False       # captured with PDL forced on
    # filled by compile_all
    ok: bool | None = None
    seconds: float = 0.0
    cubin_bytes: int = 0
    error: str = ""

    @property
    def name(self) -> str:
        module = self.kernel.__module__.removeprefix("fqkernels.")
        return f"{module}.{self.kernel.__name__}"

    def _arg_names(self, indices) -> list[str]:
        names = self.kernel.arg_names
        return [names[i] for i in sorted(indices)]

    def launch_options(self) -> str:
        """num_warps, num_stages, and every other option the launch set away from Triton's default."""
        def is_default(k, v):   # run() passes debug=None for "not set"
            d = _OPTION_DEFAULTS[k]
            return v == d or (v in (None, False) and d in (None, False))

        shown = {k: v for k, v in self.options.items()
                 if k in ("num_warps", "num_stages") or (k in _OPTION_DEFAULTS and not is_default(k, v))}
        return " ".join(f"{k}={v}" for k, v in shown.items())

    def specialization(self) -> str:
        """Constexprs, launch options, and the arguments Triton did not assume 16-aligned."""
        consts = " ".join(f"{k}={v}" for k, v in self.constants.items())
        opts = self.launch_options()
        aligned = set(self._arg_names(self.attrs.divisible_by_16))
        unaligned = [n for n, t in self.signature.items()
                     if n not in aligned and n not in self.constants and not t.startswith("fp")]
        return f"{consts} | {opts} | not /16: {','.join(unaligned) or '-'}"

    def describe(self) -> str:
        aligned = set(self._arg_names(self.attrs.divisible_by_16))
        sig = ", ".join(f"{n}: {t}{' /16' if n in aligned else ''}" for n, t in self.signature.items()
                        if n not in self.constants)
        return (f"{self.name} ({pathlib.Path(self.kernel.fn.__code__.co_filename).name})\n"
                f"  constexprs: {self.constants}\n"
                f"  arguments:  {sig}\n"
                f"  options:    {self.launch_options()}\n"
                f"  launched by {self.scenario}, at {self.site}")

    def to_json(self) -> dict:
        return {
            "kernel": self.name, "constants": {k: repr(v) if not isinstance(v, (int, float, bool, str)) else v
                                               for k, v in self.constants.items()},
            "signature": self.signature, "divisible_by_16": self._arg_names(self.attrs.divisible_by_16),
            "equal_to_1": self._arg_names(self.attrs.equal_to_1),
            "options": self.launch_options(),
            "pdl": self.pdl, "scenario": self.scenario, "site": self.site, "launches": self.launches,
            "ok": self.ok, "seconds": round(self.seconds, 3), "cubin_bytes": self.cubin_bytes, "error": self.error,
        }


class _Pointer:
    """What Triton's launch path reads of a tensor argument: its dtype and its address.
    The address is the tensor's byte offset into an allocation at ALLOCATION_ALIGNMENT."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._address = ALLOCATION_ALIGNMENT + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._address


class _SpecOnlyDriver:
    """The three driver calls JITFunction.run makes before it compiles: device 0, stream 0, the target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _as_tuples(value):
    """JSON lists back to the tuples Triton's options hold."""
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    return value


def _launch_site() -> str:
    """file:line (function) of the innermost frame outside Triton and this file: the engine's launch."""
    triton_dir = str(pathlib.Path(triton.__file__).parent)
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(triton_dir) and filename != __file__:
            path = pathlib.Path(filename)
            shown = path.relative_to(ENGINE_DIR) if path.is_relative_to(ENGINE_DIR) else path.name
            return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class Recorder:
    """Collects the distinct specializations launched while `recording()` is active."""

    def __init__(self):
        self.specs: dict[tuple, Spec] = {}
        self.scenario = "?"   # set by the caller before each scenario
        self.pdl = False

    def hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        """JITFunction.cache_hook: record the specialization; True stops run() before compile and launch."""
        kernel = fn.jit_function
        spec = self.specs.get((kernel, key))
        if spec is not None:
            spec.launches += 1
            return True
        options = {k: _as_tuples(v) for k, v in json.loads(compile["specialization_data"])["options"].items()}
        self.specs[(kernel, key)] = Spec(kernel=kernel, key=key, signature=dict(compile["signature"]),
                                         constants=dict(compile["constants"]), attrs=compile["configs"][0],
                                         options=options, scenario=self.scenario, site=_launch_site(),
                                         pdl=self.pdl)
        return True

    def keys(self) -> set:
        return {(spec.kernel, spec.key) for spec in self.specs.values()}


# Triton 3.4+ takes the launch hook from knobs.runtime.jit_cache_hook (3.1's JITFunction.cache_hook
# arguments) and compiles with the GIL released.
TRITON_3_4 = tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 4)


@contextlib.contextmanager
def recording(recorder: Recorder, target, through: bool = False) -> Iterator[None]:
    """Within: every Triton launch is bound by Triton's own JITFunction.run for `target` and
    recorded by `recorder`; nothing launches, no GPU or driver is needed. through=False: nothing
    compiles either. through=True: run() goes on as a launch's first call does, through its own
    cache lookup and compile (as a warm-up: no launch), so a cache filled from the recorded
    specializations can be checked against Triton's own launch path (scripts/precompile.py)."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    original_run = JITFunction.run

    def hook(**kwargs):
        recorder.hook(**kwargs)
        return not through          # True stops run() before it compiles and launches

    def run(self, *args, grid, warmup, **kwargs):
        with torch._C.DisableTorchFunction():   # plain tensor reads, outside MetaAsCuda
            args = tuple(_Pointer(a) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: _Pointer(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return original_run(self, *args, grid=grid, warmup=warmup or through, **kwargs)

    capturing = torch.cuda.is_current_stream_capturing
    JITFunction.run = run
    if TRITON_3_4:   # set without building a real driver first (there is none without a GPU)
        previous_driver, previous_hook = getattr(driver, "_active", None), triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = hook
        driver._active = _SpecOnlyDriver(target)
    else:
        previous_driver, previous_hook = driver.active, JITFunction.cache_hook
        JITFunction.cache_hook = hook
        driver.set_active(_SpecOnlyDriver(target))
    torch.cuda.is_current_stream_capturing = lambda: False   # asked by decode attention's workspace
    try:
        yield
    finally:
        JITFunction.run = original_run
        if TRITON_3_4:
            triton.knobs.runtime.jit_cache_hook = previous_hook
            driver._active = previous_driver
        else:
            JITFunction.cache_hook = previous_hook
            driver.set_active(previous_driver)
        torch.cuda.is_current_stream_capturing = capturing


# ----------------------------------------------------------------------------- driving the engine

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A fastqwen preset's config.json, with fields overridden: "preset[:field=json,...]"."""

    preset: str
    overrides: tuple = ()   # (config field, value) pairs

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        preset, _, rest = text.partition(":")
        overrides = []
        for item in filter(None, rest.split(",")):
            field, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"model {text!r}: override {item!r} is not field=value")
            overrides.append((field, json.loads(value)))
        return cls(preset, tuple(overrides))

    def __str__(self) -> str:
        return self.preset + (":" + ",".join(f"{k}={json.dumps(v)}" for k, v in self.overrides)
                              if self.overrides else "")


class _GemvChoice(dict):
    """TritonOps.use_gemv as its warmup `tune` could leave it: our GEMV (on) or cuBLAS (off)
    for every decode-sized product (keys are (fused, rows, N, K); tune covers rows up to
    TritonOps.GEMV_MAX_ROWS and leaves larger ones to cuBLAS)."""

    def __init__(self, on: bool, max_rows: int):
        super().__init__()
        self.on, self.max_rows = on, max_rows

    def get(self, key, default=None):
        return self.on if key[1] <= self.max_rows else default


class EngineDriver:
    """The engine's model code for one config, on meta tensors that say "cuda"."""

    def __init__(self, model: ModelSpec, folder: pathlib.Path, layers: int | None):
        import fastqwen.presets
        import fq_config
        import fq_ops
        import fq_qwen3
        import fq_weights

        raw = fastqwen.presets.get_preset(model.preset)
        raw.update(dict(model.overrides))
        if layers is not None:
            raw["num_hidden_layers"] = layers
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(raw))
        (folder / "model.safetensors").touch()
        self.cfg = fq_config.Qwen3Config.from_dir(str(folder))
        real_safe_open = fq_weights.safe_open
        fq_weights.safe_open = _MetaCheckpoint(fq_weights.expected_shapes(self.cfg))
        try:
            weights = fq_weights.load_weights(str(folder), self.cfg, CUDA)
        finally:
            fq_weights.safe_open = real_safe_open
        self.ops = fq_ops.ops_for("triton", CUDA)
        self.model = fq_qwen3.Qwen3Model(self.cfg, weights, CUDA, self.ops)

    def use_gemv(self, on: bool) -> None:
        self.ops.use_gemv = _GemvChoice(on, self.ops.GEMV_MAX_ROWS)

    def _prepare(self, batch: int, positions: int):
        """Engine._prepare's buffers in a fresh engine process (each workload gets one): RoPE
        tables for `positions`, a cache of the engine's rounded capacity for them."""
        import engine
        import fq_decode

        self.model.ensure_rope(positions)
        self.model.allocate_cache(batch, engine._rounded_capacity(positions))
        return fq_decode.DecodeRunner(self.model, batch, use_graph=False)

    def generate(self, batch: int, prompt: int, steps: int) -> None:
        """Engine.generate's launches: the prefill and the first decode step."""
        runner = self._prepare(batch, prompt + steps - 1)
        ids = torch.zeros((batch, prompt), dtype=torch.int64, device=CUDA)
        runner.start(self.model.prefill(ids), prompt)
        runner.step()

    def decode_step(self, batch: int, capacity: int) -> None:
        self._prepare(batch, capacity).step()

    def fits(self, prompt: int, steps: int) -> bool:
        return prompt + steps <= self.cfg.max_position_embeddings


Scenario = tuple[str, Callable[[], None]]


def sweep(drv: EngineDriver, label: str) -> Iterator[Scenario]:
    """The launches captured for one model: see GENERATE_SHAPES and DECODE_*."""
    for gemv in (True, False):
        tag = "gemv" if gemv else "cublas"
        for batch, prompt, steps in GENERATE_SHAPES:
            if drv.fits(prompt, steps):
                yield (f"{label} generate {batch}x{prompt}x{steps} ({tag})",
                       lambda b=batch, p=prompt, s=steps, g=gemv: (drv.use_gemv(g), drv.generate(b, p, s)))
    # The norm kernel that sums with Triton's tl.sum (rows wider than the torch-order kernel takes,
    # a torch whose order it does not implement; rmsnorm.TORCH_ORDER off).
    for batch, prompt, steps in GENERATE_SHAPES:
        if drv.fits(prompt, steps):
            yield (f"{label} generate {batch}x{prompt}x{steps} (gemv, tl.sum norm)",
                   lambda b=batch, p=prompt, s=steps: _with_tl_sum_norm(
                       lambda: (drv.use_gemv(True), drv.generate(b, p, s))))
    for batch in DECODE_BATCHES:
        yield (f"{label} decode B={batch} C=1024 (cublas)",
               lambda b=batch: (drv.use_gemv(False), drv.decode_step(b, 1024)))
        for capacity in DECODE_CAPACITIES:
            if drv.fits(capacity, 0):
                yield (f"{label} decode B={batch} C={capacity} (gemv)",
                       lambda b=batch, c=capacity: (drv.use_gemv(True), drv.decode_step(b, c)))


def _with_tl_sum_norm(run: Callable[[], None]) -> None:
    from fqkernels import rmsnorm

    saved, rmsnorm.TORCH_ORDER = rmsnorm.TORCH_ORDER, False
    try:
        run()
    finally:
        rmsnorm.TORCH_ORDER = saved


@contextlib.contextmanager
def norm_orders_measured() -> Iterator[None]:
    """Within (and within MetaAsCuda): fqkernels.rmsnorm.torch_order measures this torch's order on
    the real GPU where there is one, as the start it stands in for does (under MetaAsCuda its
    tensors would be meta ones, which torch.equal cannot compare); without a GPU it answers
    without measuring, as before."""
    from fqkernels import rmsnorm

    measure = rmsnorm.torch_order

    def torch_order(n, device):
        with torch._C.DisableTorchFunction():
            return measure(n, device)

    rmsnorm.torch_order = torch_order
    try:
        yield
    finally:
        rmsnorm.torch_order = measure


@contextlib.contextmanager
def pdl_forced(on: bool) -> Iterator[None]:
    """fqkernels.pdl as on a Triton that can (on) or cannot (off) launch with PDL."""
    from fqkernels import pdl

    saved = pdl.ENABLED, pdl.LAUNCH
    pdl.ENABLED = on
    pdl.LAUNCH = {}
    if on:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" in CUDAOptions.__dataclass_fields__:
            pdl.LAUNCH = {"launch_pdl": True}
    try:
        yield
    finally:
        pdl.ENABLED, pdl.LAUNCH = saved


def capture_engine(models, target, pdl_modes=(False,), full_depth: bool = False,
                   progress: Callable[[str], None] = lambda line: None) -> tuple[list[Spec], list[str]]:
    """Every distinct kernel specialization the engine launches over the sweep, and the
    problems found while capturing (a scenario that raised, a depth mismatch)."""
    recorder = Recorder()
    problems = []
    with tempfile.TemporaryDirectory(prefix="fq_compile_models_") as tmp, MetaAsCuda(), norm_orders_measured(), \
            torch.inference_mode():
        folders = (pathlib.Path(tmp) / str(i) for i in range(1 << 30))
        for model in models:
            for pdl_on in pdl_modes:
                label = f"{model}{' PDL' if pdl_on else ''}:"
                start, before = time.perf_counter(), len(recorder.specs)
                with pdl_forced(pdl_on):
                    drv = EngineDriver(model, next(folders), None if full_depth else SWEEP_LAYERS)
                    recorder.pdl = pdl_on
                    with recording(recorder, target):
                        for name, run in sweep(drv, label):
                            recorder.scenario = name
                            try:
                                run()
                            except Exception as exc:   # a wrapper refusing what the engine sends is a finding
                                problems.append(f"{name}: {type(exc).__name__}: {exc}")
                    if not full_depth:
                        problems += _depth_check(drv, EngineDriver(model, next(folders), None), label, target)
                progress(f"{label} {len(recorder.specs) - before} new specializations "
                         f"({time.perf_counter() - start:.1f} s)")
        # The Qwen3.5 model's kernels (the Triton op set's GDN step and prompt pass, the attention at
        # head_dim 256 and the products on our GEMV), and the decode attention's FA2 path (one split),
        # launched at the 4B's shapes so they compile with the platform's Triton too; the launch plans
        # the bench varies too.
        recorder.pdl = False
        with recording(recorder, target):
            for batch in (1, 4, 16):
                for name, run in ((f"{EXTRA}qwen3.5-4b GDN decode B={batch}", _gdn_decode_step),
                                  (f"{EXTRA}qwen3.5-4b attention decode B={batch}", _qwen35_attention),
                                  (f"{EXTRA}qwen3.5-4b decode products B={batch}", _qwen35_products),
                                  (f"{EXTRA}qwen3-4b decode attention, FA2 path, B={batch}", _fa2_attention),
                                  (f"{EXTRA}qwen3-4b exact-decode products (o, down), B={batch}", _exact_products),
                                  (f"{EXTRA}qwen3.5-4b (1 + w) norms, B={batch}", _one_plus_norms),
                                  (f"{EXTRA}paged KV cache (decode attention, KV writes), B={batch}", _paged_kv),
                                  (f"{EXTRA}speculation's rollback (masked row copies), B={batch}", _rows_copy),
                                  (f"{EXTRA}a plain step between verifies (its inputs, its pick kept), B={batch}",
                                   _spec_plain),
                                  (f"{EXTRA}a one-sequence verify's screened picks, B={batch}", _screen_rows)):
                    recorder.scenario = name
                    try:
                        run(batch)
                    except Exception as exc:
                        problems.append(f"{name}: {type(exc).__name__}: {exc}")
        # the reads before PDL's wait (pdl.EARLY) as a decode step launches them, with PDL, and the
        # exact GDN step's schedules
        if True in pdl_modes:
            recorder.pdl = True
            with pdl_forced(True), recording(recorder, target):
                for batch in (1, 4, 16):
                    name = recorder.scenario = f"{EXTRA}early reads (attention, prologues, exact GDN step), B={batch}"
                    try:
                        _early_reads(batch)
                    except Exception as exc:
                        problems.append(f"{name}: {type(exc).__name__}: {exc}")
            recorder.pdl = False
    return list(recorder.specs.values()), problems


def _early_reads(batch: int) -> None:
    """The decode attention (split and direct, gated at Qwen3.5's heads), both attention prologues and
    the exact GDN step with their reads before PDL's wait."""
    from fqkernels import gdn_exact_step
    from fqkernels.decode_attention import decode_attention
    from fqkernels.rope_kv import qk_norm_partial_rope_store, qk_norm_rope_store

    positions = torch.empty(batch, dtype=torch.int32, device=CUDA)
    for heads, kv_heads, dim in ((32, 8, 128), (16, 4, 256)):
        q = torch.empty((batch, heads, dim), dtype=torch.bfloat16, device=CUDA)
        kv = torch.empty((batch, kv_heads, 1024, dim), dtype=torch.bfloat16, device=CUDA)
        gate = None
        if dim == 256:
            gate = torch.empty((batch, heads, 2 * dim), dtype=torch.bfloat16, device=CUDA)[..., dim:]
        for splits in (None, 1):
            decode_attention(q, kv, kv, positions, dim ** -0.5, num_splits=splits, gate=gate, early=True)
    norm = torch.empty(128, dtype=torch.bfloat16, device=CUDA)
    cos = torch.empty((4096, 128), dtype=torch.bfloat16, device=CUDA)
    cache = torch.empty((batch, 8, 1024, 128), dtype=torch.bfloat16, device=CUDA)
    qk_norm_rope_store(torch.empty((batch, 48 * 128), dtype=torch.bfloat16, device=CUDA), norm, norm, cos, cos,
                       positions, 1, cache, cache, 1e-6, 32, 8, early=True)
    norm = torch.empty(256, dtype=torch.bfloat16, device=CUDA)
    table = torch.empty((4096, 64), dtype=torch.bfloat16, device=CUDA)
    cache = torch.empty((batch, 4, 1024, 256), dtype=torch.bfloat16, device=CUDA)
    qk_norm_partial_rope_store(torch.empty((batch, 10240), dtype=torch.bfloat16, device=CUDA), norm, norm, table,
                               table, positions, cache, cache, 1e-6, 16, 4, early=True)
    packed = torch.empty((batch, 8192 + 4096 + 64), dtype=torch.bfloat16, device=CUDA)
    x, z = packed[:, :8192], packed[:, 8192:8192 + 4096]
    q, k, v = torch.split(x, [2048, 2048, 4096], dim=-1)
    g = torch.empty((batch, 32), dtype=torch.float32, device=CUDA)
    beta = packed[:, 8192 + 4096:8192 + 4096 + 32]
    state = torch.empty((batch, 32, 128, 128), dtype=torch.float32, device=CUDA)
    norm = (z, torch.empty(128, dtype=torch.bfloat16, device=CUDA), 1e-6)
    for form in gdn_exact_step.FORMS:
        for prefetch in ("0", "l2"):
            gdn_exact_step.fused_step(q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128),
                                      g, beta, positions, state, gdn_exact_step.ChunkRows(batch, 32, 128, 128, CUDA),
                                      form=form, norm=norm, prefetch=prefetch, early=True)
    # the merged step's schedules (gdn_exact_step.MergedPlan: auto_plan's at B = 1 and 2, and others),
    # with and without the early reads
    for early, text in ((False, "ws=64"), (False, "ws=128"), (False, "qs_late=1,ws=64"),
                        (False, "qs_late=1,keys=64,ws=64"), (True, "qs_late=1,keys=64,ws=64"), (True, "")):
        gdn_exact_step.fused_step(q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128),
                                  g, beta, positions, state, gdn_exact_step.ChunkRows(batch, 32, 128, 128, CUDA),
                                  form="merged", norm=norm, early=early,
                                  merged=gdn_exact_step.MergedPlan.from_text(text))


def _screen_rows(batch: int) -> None:
    """The LM screen over a one-sequence verify's rows (argmax_rows: its integer pass takes the row
    count at run time) on both 4B heads; it screens one sequence only, so once (batch 1)."""
    from fqkernels.lm_screen import LmScreen

    if batch == 1:
        for V in (151936, 248320):
            screen = LmScreen(torch.empty((V, 2560), dtype=torch.bfloat16, device=CUDA))
            for rows in (2, 3, 5, 9):
                screen.argmax_rows(torch.empty((rows, 2560), dtype=torch.bfloat16, device=CUDA))


def _gdn_decode_step(batch: int) -> None:
    from fqkernels import gdn_norm, gdn_prefill, gdn_step

    qk = torch.empty((batch, 16, 128), dtype=torch.bfloat16, device=CUDA)
    v = torch.empty((batch, 32, 128), dtype=torch.bfloat16, device=CUDA)
    g = torch.empty((batch, 32), dtype=torch.float32, device=CUDA)
    state = torch.empty((batch, 32, 128, 128), dtype=torch.float32, device=CUDA)
    gdn_step.decode_step(qk, qk, v, g, g.to(torch.bfloat16), state)
    mixed = torch.empty((batch, 8192), dtype=torch.bfloat16, device=CUDA)
    conv_state = torch.empty((batch, 8192, 4), dtype=torch.bfloat16, device=CUDA)
    ab = torch.empty((batch, 32), dtype=torch.bfloat16, device=CUDA)
    per_head = torch.empty(32, dtype=torch.bfloat16, device=CUDA)
    gdn_step.conv_gates_step(mixed, conv_state, torch.empty((8192, 4), dtype=torch.bfloat16, device=CUDA), ab, ab,
                        per_head, per_head)
    rows = torch.empty((batch * 32, 128), dtype=torch.bfloat16, device=CUDA)
    gdn_norm.gated_rmsnorm(rows, rows, torch.empty(128, dtype=torch.bfloat16, device=CUDA))
    # as the model calls them: mixed, z, b and a are column slices of in_proj's packed rows
    packed = torch.empty((batch, 8192 + 4096 + 64), dtype=torch.bfloat16, device=CUDA)
    mixed, z, b, a = torch.split(packed, [8192, 4096, 32, 32], dim=-1)
    gdn_step.conv_gates_step(mixed, conv_state, torch.empty((8192, 4), dtype=torch.bfloat16, device=CUDA), a, b,
                        per_head, per_head)
    gdn_norm.gated_rmsnorm(rows, z, torch.empty(128, dtype=torch.bfloat16, device=CUDA))
    # a verify's conv and gates over its rows (4 drafts: 5 rows), from the same packed product's rows
    packed_rows = torch.empty((batch, 5, 8192 + 4096 + 64), dtype=torch.bfloat16, device=CUDA)
    mixed_rows, _, b_rows, a_rows = torch.split(packed_rows, [8192, 4096, 32, 32], dim=-1)
    gdn_step.conv_gates_rows(mixed_rows, conv_state, torch.empty((8192, 4), dtype=torch.bfloat16, device=CUDA),
                             a_rows, b_rows, per_head, per_head,
                             torch.empty((5, batch, 8192, 4), dtype=torch.bfloat16, device=CUDA))
    # the step as the model runs it: in_proj's GEMV with the conv and gates in its epilogue (the
    # table's config for the batch), the rule reading beta in place
    from fqkernels import gemv

    w_in = torch.empty((8192 + 4096 + 64, 2560), dtype=torch.bfloat16, device=CUDA)
    x, z, beta, g = gdn_step.in_proj_conv_gates_step(torch.empty((batch, 2560), dtype=torch.bfloat16, device=CUDA), w_in,
                                                conv_state, torch.empty((8192, 4), dtype=torch.bfloat16, device=CUDA),
                                                per_head, per_head, 4096, gemv.select_config(*w_in.shape, False, batch))
    q, k, v = torch.split(x, [2048, 2048, 4096], dim=-1)
    gdn_step.decode_step(q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128), g, beta,
                    state)
    # the exact decode's step as fq_qwen35 runs it: the same views, the
    # decode runner's int32 positions, a cache's chunk rows
    from fqkernels import gdn_exact_step

    norm = (z, per_head.new_empty(128), 1e-6)          # the gated norm in the step, as the model runs it
    for form, step_norm, prefetch in [(f, n, p) for f in gdn_exact_step.FORMS for n in (None, norm)
                                      for p in ("0", "l2")] + [("merged", norm, "l1")]:
        gdn_exact_step.fused_step(q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128),
                                  g, beta, torch.empty((batch,), dtype=torch.int32, device=CUDA), state,
                                  gdn_exact_step.ChunkRows(batch, 32, 128, 128, CUDA), form=form, norm=step_norm,
                                  prefetch=prefetch)
    for form in gdn_exact_step.FORMS:      # a wide verify's rows a launch a row, stopped at its ends
        positions = torch.empty((batch,), dtype=torch.int32, device=CUDA)
        gdn_exact_step.fused_step(q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128),
                                  g, beta, positions, state, gdn_exact_step.ChunkRows(batch, 32, 128, 128, CUDA),
                                  form=form, ends=torch.empty_like(positions))
    # a verify's exact rule over its rows (4 drafts: 5 rows) as fq_qwen35 runs it: the conv's rows'
    # views, one launch where the grid takes the merged form, at both cumulative-sum tiles
    x_rows = torch.empty((5, batch, 8192), dtype=torch.bfloat16, device=CUDA)
    q_rows, k_rows, v_rows = torch.split(x_rows, [2048, 2048, 4096], dim=-1)
    for tile in (32, 64):
        gdn_exact_step.fused_rows(q_rows.reshape(5, batch, 16, 128), k_rows.reshape(5, batch, 16, 128),
                                  v_rows.reshape(5, batch, 32, 128), torch.empty((5, batch, 32), device=CUDA),
                                  torch.empty((5, batch, 32), dtype=torch.bfloat16, device=CUDA),
                                  torch.empty((batch,), dtype=torch.int32, device=CUDA), state,
                                  gdn_exact_step.ChunkRows(batch, 32, 128, 128, CUDA), tile=tile)
    gdn_exact_step.fused_rows(q_rows.reshape(5, batch, 16, 128), k_rows.reshape(5, batch, 16, 128),   # stopped at ends
                              v_rows.reshape(5, batch, 32, 128), torch.empty((5, batch, 32), device=CUDA),
                              torch.empty((5, batch, 32), dtype=torch.bfloat16, device=CUDA),
                              torch.empty((batch,), dtype=torch.int32, device=CUDA), state,
                              gdn_exact_step.ChunkRows(batch, 32, 128, 128, CUDA), tile=32,
                              ends=torch.empty((batch,), dtype=torch.int32, device=CUDA))
    # a prompt's gated norm: rows several to a program
    many = torch.empty((8192, 128), dtype=torch.bfloat16, device=CUDA)
    gdn_norm.gated_rmsnorm(many, many, torch.empty(128, dtype=torch.bfloat16, device=CUDA))
    # the prompt pass's rule (chunked, two kernels), a prompt of 512
    qk = torch.empty((batch, 512, 16, 128), dtype=torch.bfloat16, device=CUDA)
    v = torch.empty((batch, 512, 32, 128), dtype=torch.bfloat16, device=CUDA)
    g = torch.empty((batch, 512, 32), dtype=torch.float32, device=CUDA)
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16))
    # other launch plans the bench's GDN sweep times
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16), plan=gdn_prefill.PrefillPlan(block_v=64, state_stages=1))
    # the solve and state kernels on bf16 pairs (a candidate plan)
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16), plan=gdn_prefill.PrefillPlan(prec="bf16x2", block_v=16))
    # the solve and state kernels on bf16 thirds, capped, one stage
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16),
                        plan=gdn_prefill.PrefillPlan(prec="bf16x3", solve_maxnreg=168, state_maxnreg=168, state_stages=1))
    # register caps (maxnreg) on every kernel
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16),
                        plan=gdn_prefill.PrefillPlan(solve_maxnreg=168, state_maxnreg=168, out_maxnreg=168))
    # the state kernel from the solve's inverse (form "inverse"), the inverse merged from 16-blocks
    # ("merged"), and FAST_PLAN (Triton 3.6's default: merged, bf16 thirds, caps) at both column
    # counts its block_v 0 picks (which asks the device for its SMs: none here)
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16), plan=gdn_prefill.PrefillPlan(form="inverse"))
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16), plan=gdn_prefill.PrefillPlan(form="merged"))
    for columns in (32, 64):
        gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16),
                            plan=dataclasses.replace(gdn_prefill.FAST_PLAN, block_v=columns))
    # a sequence continued from its state (a prompt in chunks)
    state = torch.empty((batch, 32, 128, 128), dtype=torch.float32, device=CUDA)
    gdn_prefill.chunked_prefill(qk, qk, v, g, g.to(torch.bfloat16), state_out=state, initial_state=state)
    # the exact decode step's copies of torch's l2 norm and cumulative sum (the step itself: above)
    gdn_exact_step.torch_rows(torch.empty((4, 128), dtype=torch.float32, device=CUDA), "l2norm")
    gdn_exact_step.torch_rows(torch.empty((4, 64), dtype=torch.float32, device=CUDA), "cumsum")
    # the prompt's conv, reading in_proj's packed output (qkv | z | b | a) in place
    packed = torch.empty((batch, 512, 8192 + 4096 + 64), dtype=torch.bfloat16, device=CUDA)
    gdn_prefill.causal_conv_prefill(packed[..., :8192], torch.empty((8192, 4), dtype=torch.bfloat16, device=CUDA))
    # continued from a conv state (a prompt in chunks)
    gdn_prefill.causal_conv_prefill(packed[..., :8192], torch.empty((8192, 4), dtype=torch.bfloat16, device=CUDA),
                            conv_state=torch.empty((batch, 8192, 4), dtype=torch.bfloat16, device=CUDA))
    # the prompt's gates, reading b and a in place from the same rows
    gdn_prefill.gates(packed[..., 8192 + 4096 + 32:], packed[..., 8192 + 4096:8192 + 4096 + 32], per_head, per_head)


# Scenario names of the launches made outside the Qwen3 engine sweep.
EXTRA = "extra: "


def _attention(batch: int, heads: int, kv_heads: int, head_dim: int, num_splits=None) -> None:
    from fqkernels.decode_attention import decode_attention

    q = torch.empty((batch, heads, head_dim), dtype=torch.bfloat16, device=CUDA)
    kv = torch.empty((batch, kv_heads, 1024, head_dim), dtype=torch.bfloat16, device=CUDA)
    decode_attention(q, kv, kv, torch.empty(batch, dtype=torch.int32, device=CUDA), head_dim ** -0.5,
                     num_splits=num_splits)


def _qwen35_attention(batch: int) -> None:
    from fqkernels.rope_kv import partial_rope, rope_store_kv
    from fqkernels.swiglu import sigmoid_gate_mul

    _attention(batch, 16, 4, 256)
    cs = torch.empty((batch, 64), dtype=torch.bfloat16, device=CUDA)
    for heads in (16, 4):
        partial_rope(torch.empty((batch, heads, 256), dtype=torch.bfloat16, device=CUDA), cs, cs)
    # the decode step's query: the tables read at the positions
    partial_rope(torch.empty((batch, 16, 256), dtype=torch.bfloat16, device=CUDA), cs, cs,
                 positions=torch.empty(batch, dtype=torch.int32, device=CUDA))
    # the step's key and value into the caches (k normed, v: column views of their products' rows)
    kv = torch.empty((batch, 2, 4, 256), dtype=torch.bfloat16, device=CUDA)
    table = torch.empty((4096, 64), dtype=torch.bfloat16, device=CUDA)
    cache = torch.empty((batch, 4, 1024, 256), dtype=torch.bfloat16, device=CUDA)
    rope_store_kv(kv[:, 0], kv[:, 1], table, table, torch.empty(batch, dtype=torch.int32, device=CUDA), cache, cache)
    # the fused prologue the decode step runs: the packed q | k | v rows' norms and RoPE, K/V into the caches
    from fqkernels.rope_kv import qk_norm_partial_rope_store

    norm = torch.empty(256, dtype=torch.bfloat16, device=CUDA)
    qk_norm_partial_rope_store(torch.empty((batch, 10240), dtype=torch.bfloat16, device=CUDA), norm, norm, table, table,
                               torch.empty(batch, dtype=torch.int32, device=CUDA), cache, cache, 1e-6, 16, 4)
    # the output gate: decode_attention's rows times the sigmoid of the gate read in place from the
    # packed q | k | v product's rows (per head [query | gate]); a prompt's, from SDPA's transposed
    # output and q_proj's own rows
    qkv = torch.empty((batch, 10240), dtype=torch.bfloat16, device=CUDA)
    sigmoid_gate_mul(torch.empty((batch, 16, 256), dtype=torch.bfloat16, device=CUDA).unsqueeze(1),
                     qkv[:, :8192].view(batch, 1, 16, 512)[..., 256:])
    qp = torch.empty((batch, 512, 8192), dtype=torch.bfloat16, device=CUDA)
    sigmoid_gate_mul(torch.empty((batch, 16, 512, 256), dtype=torch.bfloat16, device=CUDA).transpose(1, 2),
                     qp.view(batch, 512, 16, 512)[..., 256:])
    # the gate in the attention's merge, as the decode step runs it
    from fqkernels.decode_attention import decode_attention

    q = torch.empty((batch, 16, 256), dtype=torch.bfloat16, device=CUDA)
    kv = torch.empty((batch, 4, 1024, 256), dtype=torch.bfloat16, device=CUDA)
    decode_attention(q, kv, kv, torch.empty(batch, dtype=torch.int32, device=CUDA), 256 ** -0.5,
                     gate=qkv[:, :8192].view(batch, 16, 512)[..., 256:])


def _paged_kv(batch: int) -> None:
    """The paged KV cache (fq_slots with page_size, a server's --block-size): the decode attention
    and the KV writes through a block table, at Qwen3-4B's and Qwen3.5-4B's heads, pages of 64
    positions (at batch 16 Qwen3's attention runs one split: the FA2 path through pages). The
    attention also with the plan's page_ids "split" (the page indices loaded before the key loop:
    a knob, off by default)."""
    from fqkernels.decode_attention import decode_attention, decode_attention_plan
    from fqkernels.rope_kv import qk_norm_rope_store, rope_store_kv

    table = torch.empty((batch, 32), dtype=torch.int32, device=CUDA)          # 32 pages of 64: 2,048 positions
    lengths = torch.empty(batch, dtype=torch.int32, device=CUDA)
    for heads, kv_heads, dim in ((32, 8, 128), (16, 4, 256)):
        pool = torch.empty((40, kv_heads, 64, dim), dtype=torch.bfloat16, device=CUDA)
        q = torch.empty((batch, heads, dim), dtype=torch.bfloat16, device=CUDA)
        decode_attention(q, pool, pool, lengths, dim ** -0.5, block_table=table)
        plan = decode_attention_plan(batch, heads, kv_heads, 32 * 64, dim, page_ids="split")
        decode_attention(q, pool, pool, lengths, dim ** -0.5, block_table=table, plan=plan)
    pool = torch.empty((40, 8, 64, 128), dtype=torch.bfloat16, device=CUDA)
    norm = torch.empty(128, dtype=torch.bfloat16, device=CUDA)
    cos = torch.empty((4096, 128), dtype=torch.bfloat16, device=CUDA)
    qk_norm_rope_store(torch.empty((batch, 48 * 128), dtype=torch.bfloat16, device=CUDA), norm, norm, cos, cos,
                       lengths, 1, pool, pool, 1e-6, 32, 8, block_table=table)
    kv = torch.empty((batch, 2, 4, 256), dtype=torch.bfloat16, device=CUDA)
    tables = torch.empty((4096, 64), dtype=torch.bfloat16, device=CUDA)
    pool = torch.empty((40, 4, 64, 256), dtype=torch.bfloat16, device=CUDA)
    rope_store_kv(kv[:, 0], kv[:, 1], tables, tables, lengths, pool, pool, block_table=table)
    from fqkernels.rope_kv import qk_norm_partial_rope_store

    qk_norm_partial_rope_store(torch.empty((batch, 10240), dtype=torch.bfloat16, device=CUDA),
                               torch.empty(256, dtype=torch.bfloat16, device=CUDA),
                               torch.empty(256, dtype=torch.bfloat16, device=CUDA), tables, tables, lengths, pool, pool,
                               1e-6, 16, 4, block_table=table)


def _qwen35_products(batch: int) -> None:
    """Qwen3.5-4B's decode products on our GEMV (what the op set runs where tune finds it faster,
    or, at 7-32 rows, where the config walks K in order: exact decode): the table's configs."""
    from fqkernels import gemv

    x = torch.empty((batch, 2560), dtype=torch.bfloat16, device=CUDA)
    for n in (12352, 10240, 248320):                     # GDN in_proj, attention q | k | v, lm_head
        gemv.linear(x, torch.empty((n, 2560), dtype=torch.bfloat16, device=CUDA))
    gemv.linear(torch.empty((batch, 9216), dtype=torch.bfloat16, device=CUDA),
                torch.empty((2560, 9216), dtype=torch.bfloat16, device=CUDA))
    gemv.linear_silu_mul(x, torch.empty((18432, 2560), dtype=torch.bfloat16, device=CUDA))
    from fqkernels.argmax import argmax

    argmax(torch.empty((batch, 248320), dtype=torch.bfloat16, device=CUDA))      # the greedy pick


def _fa2_attention(batch: int) -> None:
    """The FA2 path runs where there is one split."""
    _attention(batch, 32, 8, 128, num_splits=1)


def _one_plus_norms(batch: int) -> None:
    """Qwen3.5's (1 + w) norms at its widths: alone (the first layer's) and after the residual add;
    the attention's q and k heads read in place from the packed q | k | v product's rows."""
    from fqkernels import rmsnorm

    for n in (2560, 256):
        x = torch.empty((batch, n), dtype=torch.bfloat16, device=CUDA)
        w = torch.empty(n, dtype=torch.bfloat16, device=CUDA)
        rmsnorm.rmsnorm(x, w, 1e-6, one_plus=True)
        rmsnorm.add_rmsnorm(x, x, w, 1e-6, one_plus=True)
    qkv = torch.empty((batch, 10240), dtype=torch.bfloat16, device=CUDA)
    rmsnorm.rmsnorm(qkv[:, :8192].view(batch, 16, 512)[..., :256], w, 1e-6, one_plus=True)
    rmsnorm.rmsnorm(qkv[:, 8192:9216].view(batch, 4, 256), w, 1e-6, one_plus=True)


def _rows_copy(batch: int) -> None:
    """Qwen3.5-4B's verify rollback: its recurrent states and conv states, the first `batch` rows of
    more (fqkernels.rows_copy)."""
    from fqkernels import rows_copy

    mask = torch.empty(batch, dtype=torch.bool, device=CUDA)
    for shape, dtype in (((24, batch + 1, 32, 128, 128), torch.float32), ((24, batch + 1, 8192, 4), torch.bfloat16)):
        full = torch.empty(shape, dtype=dtype, device=CUDA)
        rows_copy.copy_rows_where(full[:, :batch], full[:, 1:], mask)


def _spec_plain(batch: int) -> None:
    """SpecRunner's plain step's bookkeeping (fqkernels.spec_plain); from 16 also at 32 and 64
    sequences, the wider blocks."""
    from fqkernels import spec_plain

    for b in (batch,) if batch < 16 else (batch, 32, 64):
        seq = torch.empty((b, 4096 + 5), dtype=torch.int64, device=CUDA)
        length, limit, pick = (torch.empty(b, dtype=torch.int64, device=CUDA) for _ in range(3))
        spec_plain.plain_inputs(seq, length, pick, torch.empty((2, b), dtype=torch.int32, device=CUDA))
        spec_plain.plain_advance(pick, seq, length, limit, torch.empty((b, 2), dtype=torch.int64, device=CUDA))


def _exact_products(batch: int) -> None:
    """Exact decode's o and down configs (gemv.EXACT_CONFIGS), each launched."""
    from fqkernels import gemv

    for (n, k), entry in gemv.EXACT_CONFIGS.items():
        x = torch.empty((batch, k), dtype=torch.bfloat16, device=CUDA)
        w = torch.empty((n, k), dtype=torch.bfloat16, device=CUDA)
        for _, cfg in entry:
            gemv.linear_partials(x, w, config=cfg)


def _depth_check(shallow: EngineDriver, full: EngineDriver, label: str, target) -> list[str]:
    """One generate shape at the config's full depth must launch what the shallow model launches."""
    batch, prompt, steps = GENERATE_SHAPES[0]
    found = []
    for drv in (shallow, full):
        recorder = Recorder()
        with recording(recorder, target):
            for gemv in (True, False):
                drv.use_gemv(gemv)
                drv.generate(batch, prompt, steps)
        found.append(recorder.keys())
    if found[0] != found[1]:
        names = sorted({kernel.__name__ for kernel, _ in found[0] ^ found[1]})
        return [f"{label} the {shallow.cfg.num_layers}-layer sweep model and the {full.cfg.num_layers}-layer "
                f"model launch different specializations of {', '.join(names)}: run with --full-depth"]
    return []


# ----------------------------------------------------------------------------- coverage

def engine_kernels() -> list:
    """Every @triton.jit function defined in engine/fqkernels/*.py."""
    import fqkernels
    from triton.runtime.jit import JITFunction

    found = []
    for info in pkgutil.iter_modules(fqkernels.__path__):
        module = importlib.import_module(f"fqkernels.{info.name}")
        found += [obj for obj in vars(module).values()
                  if isinstance(obj, JITFunction) and obj.__module__ == module.__name__]
    return found


def never_launched(specs: list[Spec]) -> list[str]:
    """Engine kernels that neither were launched nor are called by another @triton.jit function."""
    functions = engine_kernels()
    launched = {spec.kernel for spec in specs}
    missing = []
    for fn in functions:
        if fn in launched:
            continue
        call = re.compile(rf"\b{re.escape(fn.__name__)}\s*\(")
        if not any(call.search(other.src) for other in functions if other is not fn):
            missing.append(f"{fn.__module__.removeprefix('fqkernels.')}.{fn.__name__}")
    return missing


# ----------------------------------------------------------------------------- compile

def _importable(kernel) -> bool:
    """Whether a fresh process finds `kernel` as <its module>.<its name> (so a worker can compile it)."""
    module = sys.modules.get(kernel.__module__)
    return (module is not None and getattr(module, kernel.__name__, None) is kernel
            and getattr(module, "__file__", None) is not None)


def _compile_task(spec: Spec, target) -> tuple:
    return (spec.kernel.__module__, spec.kernel.__name__, spec.kernel.fn.__code__.co_filename, spec.signature,
            spec.constants, spec.attrs, spec.options, target)


# The shared memory one block may use on sm_90 (H100/H200: 227 KiB), what Triton checks at launch.
SM90_SHARED_LIMIT = 232448


def _init_worker(path: list[str]) -> None:
    sys.path[:] = path   # the parent's, so a worker imports the engine the parent captured


def _compile_one(module: str, name: str, filename: str, signature: dict, constants: dict, attrs, options: dict,
                 target, kernel=None) -> tuple:
    """(ok, seconds, cubin bytes, error): the compile JITFunction.run makes at a first launch."""
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        if kernel is None:
            kernel = getattr(importlib.import_module(module), name)
            if kernel.fn.__code__.co_filename != filename:
                raise RuntimeError(f"the worker imported {module}.{name} from {kernel.fn.__code__.co_filename}, "
                                   f"not {filename}")
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options)
        shared = getattr(compiled.metadata, "shared", 0)
        if target.arch == 90 and shared > SM90_SHARED_LIMIT:
            # What the launch would raise (OutOfResources) on the GPU, caught here without one.
            return (False, time.perf_counter() - start, 0,
                    f"needs {shared} bytes of shared memory, sm_90 allows {SM90_SHARED_LIMIT} a block")
        return True, time.perf_counter() - start, len(compiled.asm["cubin"]), ""
    except Exception as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return False, time.perf_counter() - start, 0, text


def compile_all(specs: list[Spec], target, jobs: int = 0, cache_dir: str | None = None,
                progress: Callable[[str], None] = lambda line: None) -> None:
    """Compile every spec for `target` into `cache_dir` (default: a fresh temporary one, so
    every compile really runs) and fill in ok / seconds / cubin_bytes / error.

    jobs: worker processes (0: one per CPU; 1: all in this process). Workers are spawned,
    not forked (a fork of a process that has compiled before can deadlock in the
    compiler's thread pool); they import each kernel by its module's name, so a kernel
    no fresh process can import compiles in this process."""
    jobs = jobs or os.cpu_count() or 1
    own_dir = cache_dir is None
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="fq_triton_cache_")
    saved_env = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = cache_dir   # read at each compile; spawned workers inherit it
    done = 0

    def finish(spec: Spec, result: tuple) -> None:
        nonlocal done
        spec.ok, spec.seconds, spec.cubin_bytes, spec.error = result
        done += 1
        progress(f"[{done}/{len(specs)}] {'ok  ' if spec.ok else 'FAIL'} {spec.seconds:5.1f} s  {spec.name}")

    try:
        pooled = {id(s) for s in specs if jobs > 1 and _importable(s.kernel)}
        with contextlib.ExitStack() as stack:
            futures = {}
            if pooled:
                pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                    max_workers=min(jobs, len(pooled)), mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker, initargs=(list(sys.path),)))
                futures = {pool.submit(_compile_one, *_compile_task(s, target)): s for s in specs if id(s) in pooled}
            for spec in specs:
                if id(spec) not in pooled:
                    finish(spec, _compile_one(*_compile_task(spec, target), kernel=spec.kernel))
            for future in concurrent.futures.as_completed(futures):
                finish(futures[future], future.result())
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved_env
        if own_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)


def failure_report(spec: Spec, target, error_lines: int = 30) -> str:
    lines = spec.error.splitlines()
    if len(lines) > error_lines:
        lines = ["..."] + lines[-error_lines:]
    error = "\n".join("    " + line for line in lines)
    return (f"COMPILE FAILED for sm_{target.arch} with Triton {triton.__version__}: {spec.describe()}\n"
            f"  error:\n{error}")


# ----------------------------------------------------------------------------- CLI

def _table(specs: list[Spec]) -> str:
    rows = sorted(specs, key=lambda s: (s.name, s.pdl, s.specialization()))
    width = max(len(s.name) for s in rows)
    lines = [f"{'kernel':<{width}}  {'s':>5}  {'status':<6} specialization   [first launched by]"]
    for s in rows:
        status = "ok" if s.ok else ("FAIL" if s.ok is False else "-")
        lines.append(f"{s.name:<{width}}  {s.seconds:5.1f}  {status:<6} {s.specialization()}"
                     f"{' | PDL forced' if s.pdl else ''}   [{s.scenario}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="sm_90", help="GPU architecture to compile for (default sm_90)")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                   help="presets, optionally preset:field=value,... (default: %(default)s)")
    p.add_argument("--pdl", choices=("off", "on", "both"), default="off",
                   help="off: as the engine launches on Triton 3.1 (default); on: PDL forced on")
    p.add_argument("--jobs", type=int, default=0, help="compile processes (default: one per CPU)")
    p.add_argument("--cache-dir", help="Triton cache directory (default: a fresh temporary one)")
    p.add_argument("--json", help="write every specialization and its result to this file")
    p.add_argument("--capture-only", action="store_true", help="list the specializations, compile nothing")
    p.add_argument("--engine-dir", help="the engine folder to check (default: this repository's engine/)")
    p.add_argument("--full-depth", action="store_true", help=f"sweep the models at full depth, not {SWEEP_LAYERS}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    reason = unsupported_reason()
    if reason:
        print(f"compile_kernels: cannot check here: {reason}", file=sys.stderr)
        return 2
    try:
        target = parse_target(args.target)
        models = [ModelSpec.parse(m) for m in args.models]
    except ValueError as exc:
        p.error(str(exc))
    say = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    if args.engine_dir:
        use_engine_dir(pathlib.Path(args.engine_dir))

    t0 = time.perf_counter()
    pdl_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.pdl]
    specs, problems = capture_engine(models, target, pdl_modes, args.full_depth, progress=say)
    missing = never_launched(specs)
    t_capture = time.perf_counter() - t0
    say(f"captured {len(specs)} specializations of {len({s.kernel for s in specs})} kernels from "
        f"{sum(s.launches for s in specs)} launches in {t_capture:.1f} s")
    if not args.capture_only:
        compile_all(specs, target, args.jobs, args.cache_dir, progress=say)
    t_total = time.perf_counter() - t0

    print(_table(specs))
    failed = [s for s in specs if s.ok is False]
    for spec in failed:
        print("\n" + failure_report(spec, target))
    for problem in problems:
        print(f"\nCAPTURE PROBLEM: {problem}")
    for name in missing:
        print(f"\nNEVER LAUNCHED: {name} is an @triton.jit kernel in engine/fqkernels that no scenario of "
              f"scripts/compile_kernels.py reaches (and no other kernel calls): add a scenario that launches it")
    kernels = len({s.kernel for s in specs})
    if args.capture_only:
        print(f"\nTriton {triton.__version__}, sm_{target.arch}: {len(specs)} specializations of {kernels} kernels "
              f"captured (not compiled) in {t_capture:.1f} s")
    else:
        print(f"\nTriton {triton.__version__}, sm_{target.arch}: {sum(1 for s in specs if s.ok)}/{len(specs)} "
              f"specializations of {kernels} kernels compiled to cubins, {len(failed)} failed; capture "
              f"{t_capture:.1f} s, compile {sum(s.seconds for s in specs):.1f} s of CPU, wall {t_total:.1f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "triton": triton.__version__, "target": args.target, "models": [str(m) for m in models],
            "pdl": args.pdl, "capture_s": round(t_capture, 2), "wall_s": round(t_total, 2),
            "never_launched": missing, "problems": problems, "specs": [s.to_json() for s in specs],
        }, indent=1))
    return 1 if failed or missing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
