"""Which device a step is built for, and what that device is like.

A step's programs are decided for the devices it is lowered for, not the host: the
arguments' shardings (a compile-only H100 topology's devices included), else the mesh in
context, else the default backend. `profile_of` finds that device; `PROFILES` holds what
aotgrad knows of each (a frozen table; each number with its source).

What differs between devices today:
- how recomputation waits for its cotangent (`partition/schedule.py`: data ties where XLA
  removes barriers, on CPU; barriers elsewhere): chosen again at lowering, per platform;
- whether a recomputed value that a backward matmul reads costs its write and read
  (`matmul_operands_cost`), in the cuts below budget 1 (budget 1 is the fused step's plan
  in one jit, and run apart the cut priced by what crosses, alike on every device:
  `min_cut.Problem.crossing`): on GPU and TPU step time follows the bytes a step moves, and a matmul
  reads its operands from memory, so a recomputed operand is written there and read back;
  a saved one was written in the forward anyway (it was a forward matmul's operand too).
  On XLA:CPU charging them did not make a step faster (an Equinox ViT at the cheapest
  cut: 1.14x plain jit's step time with the charge, 1.08-1.11x without, at a higher
  peak), so there the lower peak is kept;
- what recomputing a reduction costs (`partition/costs.py`, `row_reductions_fuse`):
  XLA:GPU runs a reduction over the last axis in one kernel with the elementwise work
  around it (a softmax, a layer norm, a cross-entropy's log-sum-exp), so recomputing one
  re-reads nothing its neighbours do not read anyway. GPT-2 small on an H100 at budget
  0: 155.7 GB moved instead of 165.3, the same peak (docs/benchmarks.md). XLA:TPU moved
  more bytes with reductions priced so (a GPT at budget 0: 3.06 GB against 2.93): there
  a recomputed reduction still re-reads its input;
- what recomputing a transcendental function costs (`transcendentals`,
  `partition/costs.py`): on a GPU, `exp` or `log` is one special-function instruction
  per element and recomputing one costs a fifth of moving its output (float32, H100),
  not as much as moving it once more (on a CPU, a polynomial of tens of instructions).
  GPT-2 small on an H100, in the cut just below the cheapest (budget 0.99 before the
  ladder had blends), then saves the attention scores and recomputes their softmax, as
  `dots_saveable` does, and moves that policy's bytes (docs/benchmarks.md);
- whether saving a value inside a row normalization costs a pass over its input
  (`row_reductions_fuse` again, `partition/min_cut.py`): XLA:GPU runs a softmax or a
  layer norm as one kernel only while nothing inside it (its max, its sum, values
  computed from them) must be written out; saving one splits it into kernels that each
  read the row again. A transformer block at budget 0.5 saved the softmax's max beside
  the scores and moved 27.8 GB, 21.1 once a saved max costs that read;
- whether the budget offers cuts that keep the loss head (`keeps_loss_head`,
  `partition/budget.py`): on XLA:GPU a low budget that checkpoints each block and keeps
  the logits peaked no higher, and moved fewer bytes and FLOPs, than one that recomputes
  them (GPT-2 small on an H100 at budget 0.1, when they came: 4.15 GB / 154.0 GB moved /
  8278 GFLOP against 4.78 / 159.8 / 8649; the same on 8 H100s, data parallel and FSDP,
  and on a GPT with D=1024).
  XLA:TPU moved more bytes with them (GPT-2 small 123.1 GB against 108.8, a GPT with
  D=1024 56.4 against 52.9, the latter at a higher peak), so there they are not offered;
- what the budget ranks its candidate cuts by (`ranks_by_traffic`, `partition/budget.py`):
  on a GPU, the bytes the whole step moves as `partition/traffic.py` follows XLA:GPU's
  fusion (each value in memory read once by each kernel that reads it), not the min cut's
  per-value costs, which charge a saved value one read in the backward. A cut that saves
  a block's last matmul output and not the residual sum it feeds has that output read by
  every kernel that recomputes the sum: a ViT-B/16 on an H100 at budget 0.33 moved 155.26
  GB (1.022x `dots_with_no_batch_dims_saveable`'s) ranked by the per-value costs, 150.58
  (0.991x) ranked by the traffic. On XLA:TPU, ranked by the traffic alone, GPT-2 small at
  budget 0.99 moved more (108.57 GB against 103.47, at a higher peak), so there, and on
  XLA:CPU (not measured), the per-value costs rank.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import jax

__all__ = ["PROFILES", "DeviceProfile", "device_count_of", "profile_named", "profile_of"]


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One kind of device. FLOP/s are dense (no sparsity) matmul peaks per operand dtype."""
    name: str
    platform: str  # "cpu", "gpu" or "tpu"
    device_kinds: tuple[str, ...]  # substrings of `Device.device_kind` that name it
    matmul_flops: tuple[tuple[str, float], ...] = ()  # (dtype, FLOP/s); empty: not known
    memory_bandwidth: float | None = None  # bytes/s
    memory_bytes: int | None = None  # per device
    matmul_operands_cost: bool = False  # see the module docstring
    row_reductions_fuse: bool = False  # see the module docstring
    keeps_loss_head: bool = False  # see the module docstring
    transcendentals: float | None = None  # elementwise exp/log/sin/... results per second
    ranks_by_traffic: bool = False  # see the module docstring

    def transcendental_cost(self, itemsize: int) -> float | None:
        """Bytes moved in the time one transcendental result of `itemsize` bytes is
        computed, per byte of it (None: not known)."""
        if not self.transcendentals or not self.memory_bandwidth:
            return None
        return self.memory_bandwidth / (self.transcendentals * itemsize)

    def flops(self, dtype: str) -> float | None:
        return dict(self.matmul_flops).get(dtype)

    def balance(self, dtype: str = "float32") -> float | None:
        """FLOPs the device computes in the time it moves one byte (None: not known)."""
        f = self.flops(dtype)
        return f / self.memory_bandwidth if f and self.memory_bandwidth else None


_T = 1e12
PROFILES: tuple[DeviceProfile, ...] = (
    # The host's CPU: no fixed numbers (any x86 or ARM machine).
    DeviceProfile("cpu", "cpu", ("cpu",)),
    # NVIDIA H100 SXM5 80GB datasheet: HBM3 3.35 TB/s; dense TF32 494.7, BF16/FP16 989.4
    # TFLOP/s (float32 matmuls run as TF32 at JAX's default precision on GPUs).
    # Transcendentals: CUDA C++ Programming Guide, arithmetic instruction throughput,
    # compute capability 9.0: 16 special-function results (exp2, log2, sin, rsqrt...) per
    # clock per SM; H100 whitepaper: 132 SMs, 1.98 GHz boost.
    DeviceProfile("h100", "gpu", ("H100",), (("float32", 494.7 * _T), ("bfloat16", 989.4 * _T),
                                             ("float16", 989.4 * _T)), 3.35e12, 80 * 2**30, True,
                  row_reductions_fuse=True, keeps_loss_head=True, transcendentals=132 * 16 * 1.98e9,
                  ranks_by_traffic=True),
    # NVIDIA A100 SXM4 80GB datasheet: HBM2e 2,039 GB/s; dense TF32 156, BF16/FP16 312 TFLOP/s.
    # Transcendentals: as above for compute capability 8.0 (16 per clock per SM); A100
    # whitepaper: 108 SMs, 1.41 GHz boost.
    DeviceProfile("a100", "gpu", ("A100",), (("float32", 156 * _T), ("bfloat16", 312 * _T),
                                             ("float16", 312 * _T)), 2.039e12, 80 * 2**30, True,
                  row_reductions_fuse=True, keeps_loss_head=True, transcendentals=108 * 16 * 1.41e9,
                  ranks_by_traffic=True),
    # Google Cloud TPU v5e documentation: 197 TFLOP/s bf16, HBM 16 GiB at 819 GB/s
    # (float32 matmuls run as one bf16 pass at JAX's default precision on TPUs).
    DeviceProfile("tpu-v5e", "tpu", ("v5 lite", "v5e"), (("float32", 197 * _T), ("bfloat16", 197 * _T)),
                  819e9, 16 * 2**30, True),
    # Any other GPU or TPU: its numbers are not known, its compiler's habits are.
    DeviceProfile("gpu", "gpu", (), matmul_operands_cost=True, row_reductions_fuse=True, keeps_loss_head=True,
                  ranks_by_traffic=True),
    DeviceProfile("tpu", "tpu", (), matmul_operands_cost=True),
)


def profile_named(name: str) -> DeviceProfile:
    for p in PROFILES:
        if p.name == name:
            return p
    raise ValueError(f"no device profile {name!r}; known: {[p.name for p in PROFILES]}")


def _match(platform: str, device_kind: str) -> DeviceProfile:
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    for p in PROFILES:
        if p.platform == platform and any(k.lower() in device_kind.lower() for k in p.device_kinds):
            return p
    return next((p for p in PROFILES if p.name == platform), PROFILES[0])


def _device_of(x: Any) -> tuple[str, str] | None:
    """(platform, device kind) of the devices `x` is placed on (a concrete array, a
    ShapeDtypeStruct, an abstract value or a traced value, whose type's sharding names an
    abstract mesh's device); None where not placed."""
    sharding = _sharding_of(x)
    if sharding is None:
        return None
    device = getattr(getattr(sharding, "mesh", None), "abstract_device", None)
    if device is not None:
        return device.platform, device.device_kind
    try:
        devices = sharding.device_set
    except (AttributeError, ValueError):  # an abstract mesh without devices
        return None
    d = next(iter(devices), None)
    return (d.platform, d.device_kind) if d is not None else None


def _sharding_of(x: Any) -> Any:
    try:
        return x.sharding if not isinstance(x, jax.core.Tracer) else jax.typeof(x).sharding
    except Exception:  # no sharding (a Python scalar), or none available on this value
        return None


def device_count_of(leaves: Iterable[Any]) -> int:
    """How many devices the step's shapes are split over: the size of the mesh (or device
    set) of the first placed leaf, else of the mesh in context, else 1. Manual axes do not
    count: inside `shard_map` the shapes are already one device's."""
    for x in leaves:
        sharding = _sharding_of(x)
        size = _split_size(getattr(sharding, "mesh", None))
        if size is None and sharding is not None:
            try:
                size = len(sharding.device_set)
            except (AttributeError, ValueError):  # an abstract mesh without devices
                size = None
        if size:
            return int(size)
    return max(1, _split_size(jax.sharding.get_abstract_mesh()) or 1)


def _split_size(mesh: Any) -> int | None:
    """The product of the mesh's axes that are not manual (None: no mesh)."""
    shape = getattr(mesh, "shape", None)
    if not shape:
        return getattr(mesh, "size", None)
    types = getattr(mesh, "axis_types", None) or (None,) * len(shape)
    return math.prod(n for n, t in zip(shape.values(), types, strict=True)
                     if t != jax.sharding.AxisType.Manual)


def profile_of(leaves: Iterable[Any]) -> DeviceProfile:
    """The profile of the devices these argument leaves are placed on (the first placed
    leaf decides), else of the mesh in context, else of the default backend's device."""
    for x in leaves:
        found = _device_of(x)
        if found is not None:
            return _match(*found)
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return _match(device.platform, device.device_kind)
    d = jax.devices()[0]
    return _match(d.platform, d.device_kind)
