"""Which devices a step is compiled for: a compile-only accelerator this machine does not
have, or real devices.

`resolve(target)` takes
- a name the package ships: "h100" and "a100" (XLA:GPU target descriptions in this folder,
  `GpuTargetConfigProto`s in text form), "tpu-v5e" (the topology `jax[tpu]`'s libtpu
  describes), or "cpu" (this machine's CPU devices; None means the same);
- a path to a GPU target description (a `.txtpb` file written like the shipped ones);
- real devices (a `jax.Device` or a sequence of them).
`Target.mesh(n)` is then a one-axis mesh ("data") of `n` of its devices, compile-only ones
from `jax.experimental.topologies` included: arrays cannot live there, but
`ShapeDtypeStruct`s placed on it lower and compile for it.

A GPU target needs XLA:GPU, which the CUDA compiler plugin brings (the `gpu-target` extra)
and which loads on a machine without a GPU only with `JAX_PLATFORMS=cpu`; a TPU target needs
libtpu. Without them `mesh` raises `TargetUnavailable`, naming what to install.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import pathlib
from typing import Any

import jax
import numpy as np

__all__ = ["GPU_EXTRA", "SHIPPED", "Target", "TargetError", "TargetUnavailable", "known_names", "resolve"]

GPU_EXTRA = "pip install 'aotgrad[gpu-target]' (from a clone: pip install -e '.[gpu-target]')"
TPU_EXTRA = "pip install 'jax[tpu]==<the installed jax version>'"
# A GPU host of the topology holds this many GPUs (an HGX / DGX node); more devices are
# several such hosts.
GPUS_PER_HOST = 8
# A TPU v5e slice is at most 16x16 chips.
TPU_MAX_SIDE = 16
AXIS = "data"


class TargetError(ValueError):
    """A target that does not exist, or a device count it does not have."""


class TargetUnavailable(RuntimeError):
    """The target exists but its compiler is not installed (or not loaded) here."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One kind of device to compile for."""
    name: str
    platform: str  # "cuda" or "tpu" (compile-only), else the real devices' platform
    description: str | None = None  # a GpuTargetConfigProto in text form (GPU targets)
    tpu_kind: str | None = None  # e.g. "v5e" (TPU targets)
    local: tuple[Any, ...] = ()  # real devices; empty for a compile-only target

    @property
    def compile_only(self) -> bool:
        return not self.local

    @property
    def max_devices(self) -> int | None:
        """The most devices a mesh may have (None: no limit the package knows of)."""
        if self.local:
            return len(self.local)
        return TPU_MAX_SIDE ** 2 if self.platform == "tpu" else None

    def _check_count(self, n: Any) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise TargetError(f"devices must be an int >= 1; got {n!r}.")
        n = int(n)
        most = self.max_devices
        if most is not None and n > most:
            more = (" (more CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=N before jax "
                    "is imported)" if self.platform == "cpu" else "")
            raise TargetError(f"devices={n}: target {self.name} has {most} devices{more}.")
        if self.platform == "cuda" and n > GPUS_PER_HOST and n % GPUS_PER_HOST:
            raise TargetError(f"devices={n}: a GPU target has up to {GPUS_PER_HOST} GPUs per host, and "
                              f"more devices are hosts of {GPUS_PER_HOST}: give a multiple of {GPUS_PER_HOST}.")
        if self.platform == "tpu" and math.isqrt(n) ** 2 != n:
            raise TargetError(f"devices={n}: target {self.name} is a square of chips (1, 4, 16, ...).")
        return n

    def topology(self, n: int) -> Any:
        """The compile-only topology of `n` devices (TargetUnavailable: no compiler here)."""
        from jax.experimental import topologies
        try:
            if self.platform == "cuda":
                hosts, per_host = (1, n) if n <= GPUS_PER_HOST else (n // GPUS_PER_HOST, GPUS_PER_HOST)
                return topologies.get_topology_desc(platform="cuda", target_config=self.description,
                                                    topology=f"1x{hosts}x{per_host}")
            side = math.isqrt(n)
            return topologies.get_topology_desc(topology_name=f"{self.tpu_kind}:{side}x{side}", platform="tpu",
                                                chips_per_host_bounds=(side, side, 1))
        except (RuntimeError, ValueError, NotImplementedError, ImportError) as e:
            install = GPU_EXTRA if self.platform == "cuda" else TPU_EXTRA
            raise TargetUnavailable(
                f"target {self.name}: no compile-only topology here ({type(e).__name__}: {str(e).splitlines()[0]}). "
                f"Its compiler comes from: {install}; run with JAX_PLATFORMS=cpu (set before jax is "
                f"imported).") from None

    def mesh(self, n: int = 1) -> jax.sharding.Mesh:
        """A mesh of `n` of the target's devices on one axis, "data"."""
        n = self._check_count(n)
        if self.local:
            return jax.sharding.Mesh(np.array(self.local[:n]), (AXIS,))
        from jax.experimental import topologies
        return topologies.make_mesh(self.topology(n), (n,), (AXIS,))


def _description(name: str) -> str:
    return importlib.resources.files(__name__).joinpath(f"{name}.txtpb").read_text()


# The names the package ships, and how each is built.
SHIPPED: dict[str, Any] = {
    "h100": lambda: Target("h100", "cuda", description=_description("h100")),
    "a100": lambda: Target("a100", "cuda", description=_description("a100")),
    "tpu-v5e": lambda: Target("tpu-v5e", "tpu", tpu_kind="v5e"),
    "cpu": lambda: Target("cpu", "cpu", local=tuple(jax.devices("cpu"))),
}


def known_names() -> list[str]:
    return list(SHIPPED)


def resolve(target: Any) -> Target:
    """A `Target` from a shipped name, a description file's path, or real devices."""
    if isinstance(target, Target):
        return target
    if target is None:
        target = "cpu"
    if isinstance(target, jax.Device):
        target = [target]
    if isinstance(target, (list, tuple)) and target and all(isinstance(d, jax.Device) for d in target):
        kinds = {(d.platform, d.device_kind) for d in target}
        if len(kinds) > 1:
            raise TargetError(f"target: the devices must be of one kind; got {sorted(kinds)}.")
        (platform, kind), = kinds
        return Target(kind, platform, local=tuple(target))
    if isinstance(target, str) and target in SHIPPED:
        return SHIPPED[target]()
    if isinstance(target, (str, os.PathLike)):
        path = pathlib.Path(target)
        if path.is_file():
            return Target(path.stem, "cuda", description=path.read_text())
        if path.suffix or os.sep in str(target):
            raise TargetError(f"target: no target description file at {str(path)!r}.")
    raise TargetError(f"target: unknown target {target!r}; known: {', '.join(map(repr, known_names()))}, "
                      f"a path to a GPU target description (.txtpb, a GpuTargetConfigProto in text form), "
                      f"or a sequence of jax devices.")
