"""The loaded programs of an export: an `Exported` is an `AOTFunction` whose one entry
holds the three `jax.export` programs (`export.programs`), so calls, the `custom_vjp`
glue and `fwd_and_bwd` are the compiled function's own; `deserialize` reads one from a
blob."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from aotgrad.api.cache import CacheInfo
from aotgrad.api.function import AOTFunction
from aotgrad.autocast.rewrite import CastCounts
from aotgrad.compilation_cache import ensure_compilation_cache
from aotgrad.entry import Entry
from aotgrad.export.blob import PROGRAMS, ExportError, decode_static, pack, unpack
from aotgrad.export.programs import LoadedPair, concrete, loaded_entry, spec_of
from aotgrad.partition.costs import nbytes as _nbytes
from aotgrad.report import Memory, Report, SavedValue
from aotgrad.runtime import Timings
from aotgrad.signature import ArgSpec, argnum_positions

__all__ = ["Exported", "LoadedEntries", "deserialize"]

# jax.export serializes with flatbuffers, an optional dependency: how to install it, from a
# package index and from a clone of the repository.
_FLATBUFFERS = ("needs the 'flatbuffers' package: pip install 'aotgrad[export]' (from a clone of the "
                "repository: pip install -e '.[export]')")

_NO_HOOKS = ("aotgrad.Exported({name}): hooks cannot be added to an exported function: its backward "
             "is the exported program, which hooks cannot enter. Transform the gradients after the "
             "backward instead.")


def _report_of(name: str, meta: dict[str, Any], avals: Sequence[Any], memory: Memory,
               jaxprs: dict[str, Any], compile_seconds: float) -> Report:
    """The exported report, with the saved values' types (`avals`) of one call."""
    saved = tuple(SavedValue(shape=tuple(a.shape), nbytes=_nbytes(a), **s)
                  for s, a in zip(meta["saved"], avals, strict=True))
    pairs = lambda rows: tuple((str(p), int(k)) for p, k in rows)  # noqa: E731
    return Report(function=name, partitioner=meta["partitioner"], forward_jaxpr=jaxprs["forward"],
                  backward_jaxpr=jaxprs["backward"], saved=saved,
                  saved_bytes=sum(s.nbytes for s in saved if not s.is_input),
                  saved_input_bytes=sum(s.nbytes for s in saved if s.is_input),
                  recomputed=pairs(meta["recomputed"]),
                  timings=Timings(**{**meta["timings"], "compile": compile_seconds}),
                  casts=CastCounts(pairs(meta["casts"]["forward"]), pairs(meta["casts"]["backward"])),
                  memory=memory)


class LoadedEntries:
    """Where an `Exported`'s calls find their entry (an `api.function.Entries`): its one
    entry, for calls with the exported static values, structure, dtypes and shapes."""

    def __init__(self, spec: ArgSpec, static: tuple[tuple[Any, Any], ...], entry: Entry) -> None:
        self.spec = spec
        self.static = static  # the static arguments it was exported with
        self.entry = entry

    @property
    def name(self) -> str:
        return self.spec.fn_name

    def resolve(self, args: tuple, kwargs: dict) -> tuple[Entry, tuple[Any, ...]]:
        ensure_compilation_cache()
        static, dyn_args, dyn_kwargs = self.spec.split(args, kwargs)
        if static != self.static:
            raise ExportError(f"aotgrad.Exported({self.name}): static arguments {dict(static)} differ "
                              f"from those it was exported with, {dict(self.static)}; export again "
                              f"for these values.")
        leaves, in_tree = self.spec.flatten(dyn_args, dyn_kwargs)
        entry = self.entry
        if in_tree != entry.in_tree:
            raise ExportError(f"aotgrad.Exported({self.name}): the arguments have structure {in_tree}; "
                              f"it was exported for {entry.in_tree}. Call it with arguments of that "
                              f"structure, or export again for this one.")
        wants = entry.fwd.in_avals[len(entry.fwd.consts):]
        for path, leaf, want in zip(entry.layout.paths, leaves, wants, strict=True):
            got = jax.typeof(leaf) if not isinstance(leaf, jax.ShapeDtypeStruct) else leaf
            if got.dtype != want.dtype or not _fits(got.shape, want.shape):
                raise ExportError(
                    f"aotgrad.Exported({self.name}): argument {path} is {_text(got)}; it was exported "
                    f"for {_text(want)}. Call it with that shape and dtype, or export again (with "
                    f"jax.export.symbolic_shape dimensions for sizes that vary).")
        return entry, (*entry.fwd.consts, *leaves)

    def info(self) -> CacheInfo:
        return CacheInfo(1, len(self.entry.pairs), 0, 0)

    def clear(self) -> None:
        """Nothing to clear: the programs are the export."""


class Exported(AOTFunction):
    """A forward/backward pair exported by `aotgrad.export` or loaded by `aotgrad.deserialize`.

    Call it and differentiate it like the `aotgrad.compile`d function it came from (eager,
    `jax.jit`, `jax.grad`, `jax.vjp`, `aotgrad.fwd_and_bwd`, `aotgrad.explain`), with
    arguments of the exported structure, shapes and dtypes (and the same static values).
    Its programs are fixed: `aotgrad.config` options that change programs do not apply to
    them; `.config` and `.autocast` tell what they were built under.
    """

    def __init__(self, meta: dict[str, Any], programs: dict[str, Any], consts: tuple[Any, ...]) -> None:
        spec = spec_of(meta)
        static = tuple((k, decode_static(v)) for k, v in meta["static"])
        entries = LoadedEntries(spec, static, loaded_entry(meta, programs, consts))
        super().__init__(entries)
        self.entry = entries.entry  # its one entry: the loaded programs
        self._meta = meta
        self._programs = programs
        self.__name__ = self.__qualname__ = spec.fn_name
        self.__doc__ = Exported.__doc__

    # ---------------------------------------------------------------- what it holds

    @property
    def config(self) -> dict[str, Any]:
        """The `aotgrad.config` options in force when it was exported."""
        return dict(self._meta["config"])

    @property
    def autocast(self) -> dict[str, str] | None:
        """The autocast setting it was exported under (None: off)."""
        return self._meta["autocast"]

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self._programs["forward"].platforms)

    @property
    def in_tree(self) -> Any:
        """The structure of `(args, kwargs)` it takes (static arguments excluded)."""
        return self.entry.in_tree

    @property
    def in_avals(self) -> tuple[Any, ...]:
        """The type of each argument leaf (closed-over values excluded)."""
        return self.entry.fwd.in_avals[len(self.entry.fwd.consts):]

    def serialize(self) -> bytes:
        """The bytes `aotgrad.deserialize` loads: header, metadata, programs, constants."""
        sections: dict[str, bytes] = {}
        for name in PROGRAMS:
            try:
                sections[name] = bytes(self._programs[name].serialize())
            except (ValueError, TypeError) as e:
                raise ExportError(f"aotgrad.Exported({self.name}).serialize: the argument or output "
                                  f"structure cannot be stored: {e} (in the loading process too), or "
                                  f"pass dicts, lists and tuples.") from e
            except ImportError as e:
                raise ExportError(f"aotgrad.Exported({self.name}).serialize {_FLATBUFFERS}. {e}") from e
        consts = []
        for i, c in enumerate(self.entry.fwd.consts):
            if jax.dtypes.issubdtype(c.dtype, jax.dtypes.extended):
                raise ExportError(f"aotgrad.Exported({self.name}).serialize: closed-over value {i} is "
                                  f"a {c.dtype} array, which cannot be stored; pass it as an argument.")
            data = np.ascontiguousarray(jax.device_get(c))
            sections[f"const{i}"] = data.tobytes()
            consts.append({"dtype": np.dtype(data.dtype).name, "shape": list(data.shape)})
        return pack({**self._meta, "consts": consts}, sections)

    # ---------------------------------------------------------------- calling

    def explain(self, *args: Any, argnums: int | Sequence[int] | None = None, **kwargs: Any) -> Report:
        """The report made when it was exported (saved values with their source lines,
        recomputed primitives, casts), with XLA's memory analysis of the loaded programs."""
        traced = self.trace(*args, **kwargs)
        entry = traced.entry
        if argnums is not None:
            positions = argnum_positions(f"aotgrad.explain({self.name})", argnums, len(args))
            if entry.perturbed_for(positions) != entry.default_perturbed:
                raise ExportError(f"aotgrad.explain({self.name}): argnums={argnums} differentiates other "
                                  f"inputs than the exported programs; explain it without argnums.")
        pair = traced.pair()
        assert isinstance(pair, LoadedPair)
        loaded = pair.programs
        results = jax.eval_shape(loaded.forward, *traced.inputs)  # binds symbolic dimensions
        avals = [*results[pair.n_outs:], *(traced.inputs[i] for i in loaded.saved_inputs)]
        if not all(concrete(a.shape) for a in avals):
            raise ExportError(f"aotgrad.explain({self.name}): the export has symbolic dimensions; "
                              f"explain it for arrays (or ShapeDtypeStructs) of concrete shapes.")
        compiled = traced.lower().compile()
        jaxprs = {name: jax.make_jaxpr(self._programs[name].call)(*self._programs[name].in_avals)
                  for name in ("forward", "backward")}
        return _report_of(self.name, self._meta["report"], avals, Memory.of(compiled), jaxprs,
                          compiled.timings.compile)

    def register_prehook(self, fn: Callable[[Any], Any]) -> Any:
        """Not supported: the backward is the exported program (raises `ExportError`)."""
        raise ExportError(_NO_HOOKS.format(name=self.name))

    def register_hook(self, fn: Callable[..., Any], per_leaf: bool = False) -> Any:
        """Not supported: the backward is the exported program (raises `ExportError`)."""
        raise ExportError(_NO_HOOKS.format(name=self.name))

    def __repr__(self) -> str:
        return f"aotgrad.Exported({self.name})"


def _fits(got: Sequence[Any], want: Sequence[Any]) -> bool:
    """Same rank, and equal wherever the exported dimension is a number."""
    return len(got) == len(want) and all(
        not isinstance(w, (int, np.integer)) or g == w for g, w in zip(got, want, strict=True))


def _text(aval: Any) -> str:
    return f"{np.dtype(aval.dtype).name}[{', '.join(map(str, aval.shape))}]"


def deserialize(blob: bytes) -> Exported:
    """Loads an `Exported` from the bytes of `Exported.serialize()`, in any process on the
    platform it was exported for; the exported function's source is not needed.

    Arguments:
        blob: the bytes.
    """
    ensure_compilation_cache()
    meta, sections = unpack(blob)
    try:
        programs = {name: jax.export.deserialize(bytearray(sections[name])) for name in PROGRAMS}
    except ImportError as e:
        raise ExportError(f"aotgrad.deserialize {_FLATBUFFERS}. {e}") from e
    except Exception as e:
        raise ExportError(f"aotgrad.deserialize: the export's programs cannot be read: {e}. If the "
                          f"pytrees hold types registered with jax.export.register_pytree_node_"
                          f"serialization, register them in this process too, before loading.") from e
    platform = jax.export.default_export_platform()
    made_for = programs["forward"].platforms
    if platform not in made_for:
        raise ExportError(f"aotgrad.deserialize: {meta.get('name')} was exported for platform(s) "
                          f"{list(made_for)}; this process runs on {platform!r}. Export it on "
                          f"{platform!r}, or pass platforms=[..., {platform!r}] to aotgrad.export.")
    devices = programs["forward"].nr_devices
    if devices > jax.device_count():
        raise ExportError(f"aotgrad.deserialize: {meta.get('name')} was exported for {devices} devices; "
                          f"this process has {jax.device_count()}. Load it where as many devices are "
                          f"visible, or export it for this device count.")
    try:
        consts = tuple(jax.numpy.asarray(np.frombuffer(sections[f"const{i}"], jax.numpy.dtype(c["dtype"]))
                                         .reshape(c["shape"])) for i, c in enumerate(meta.pop("consts")))
        return Exported(meta, programs, consts)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ExportError(f"aotgrad.deserialize: the export's metadata is not what this aotgrad "
                          f"writes ({type(e).__name__}: {e}).") from e
