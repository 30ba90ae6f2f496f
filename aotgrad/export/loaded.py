"""The loaded programs of an export: an `Exported` is an `AOTFunction` whose entry holds
the three `jax.export` programs (in the shape of `runtime.Entry`), so calls, the
`custom_vjp` glue and `fwd_and_bwd` are the compiled function's own; `deserialize` reads
one from a blob."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding
from jax.tree_util import tree_leaves, tree_structure, tree_unflatten

from aotgrad.api.function import AOTFunction, CacheInfo, _Call
from aotgrad.api.stages import Lowered
from aotgrad.autocast.rewrite import CastCounts
from aotgrad.compilation_cache import ensure_compilation_cache
from aotgrad.export.blob import PROGRAMS, ExportError, decode_static, pack, unpack
from aotgrad.partition.costs import nbytes as _nbytes
from aotgrad.report import Memory, Report, SavedValue
from aotgrad.runtime import Entry, Saved, Timings
from aotgrad.signature import ArgSpec, argnum_positions, leaf_paths

__all__ = ["Exported", "concrete", "deserialize", "spec"]

_NO_HOOKS = ("aotgrad.Exported({name}): hooks cannot be added to an exported function: its backward "
             "is the exported program, which hooks cannot enter. Transform the gradients after the "
             "backward instead.")


@dataclasses.dataclass(frozen=True)
class _Forward:
    """What the runtime reads of a forward trace (`trace.ForwardTrace`), for loaded programs."""
    consts: tuple[Any, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    out_tree: Any


def concrete(shape: Sequence[Any]) -> bool:
    return all(isinstance(d, (int, np.integer)) for d in shape)


def spec(x: Any) -> jax.ShapeDtypeStruct:
    """The export spec of one input: its type, and its sharding when it spans devices."""
    sharding = getattr(x, "sharding", None)
    if sharding is not None and (type(sharding) is SingleDeviceSharding or len(sharding.device_set) == 1):
        sharding = None
    aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False),
                                sharding=sharding)


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


# ----------------------------------------------------------------------------- the loaded programs

class _Pair:
    """The exported forward and backward, seen by one differentiation pattern: `perturbed`
    and `has_ct` are subsets of those exported (cotangents the pattern lacks are zeros,
    gradients it does not ask for are dropped). Duck-types `runtime.ProgramPair` for the
    `custom_vjp` rule and `fwd_and_bwd`."""

    detect_anomaly = False  # a loaded pair runs the exported backward as it is

    def __init__(self, entry: "_Entry", perturbed: tuple[bool, ...], has_ct: tuple[bool, ...]) -> None:
        self.owner = entry.owner
        self.entry = entry
        self.perturbed = perturbed
        self.has_ct = has_ct
        self.in_avals = entry.fwd.in_avals
        self.n_outs = len(entry.fwd.out_avals)
        self.layouts: dict[object, Any] = {}
        self._keep = [p for p, q in zip(perturbed, entry.exported_perturbed, strict=True) if q]

    def run_forward(self, inputs: Sequence[Any], hooks: Any = None) -> tuple[list[Any], Saved]:
        assert hooks is None  # an Exported refuses hooks
        results = self.entry.forward(*inputs)
        saved = list(results[self.n_outs:])
        saved.extend(inputs[i] for i in self.entry.saved_inputs)
        return list(results[:self.n_outs]), Saved(saved, self)

    def run_backward(self, saved: Saved, cts: Sequence[Any],
                     present: tuple[bool, ...] | None = None) -> list[Any]:
        """`present`: which of the cotangents `has_ct` names are given (the others are
        zero: the exported backward takes them all, so they are filled in)."""
        given = iter(cts)
        marks = iter(present) if present is not None else None
        full = []
        for j, (want, have) in enumerate(zip(self.entry.exported_has_ct, self.has_ct, strict=True)):
            here = have and (marks is None or next(marks))
            if want:
                aval = self.entry.fwd.out_avals[j]
                full.append(next(given) if here else jax.numpy.zeros(aval.shape, aval.dtype))
        grads = self.entry.backward(*saved.arrays, *full)
        return [g for g, keep in zip(grads, self._keep, strict=True) if keep]

    def lower(self, inputs: Sequence[Any]) -> tuple[Any, Any, Timings]:
        """Both programs lowered for these inputs (the backward for the saved values and
        cotangents they give)."""
        results = jax.eval_shape(self.entry.forward, *inputs)
        outs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in results[:self.n_outs]]
        specs = [*results[self.n_outs:], *(spec(inputs[i]) for i in self.entry.saved_inputs),
                 *(o for o, c in zip(outs, self.entry.exported_has_ct, strict=True) if c)]
        return self.entry.forward.lower(*inputs), self.entry.backward.lower(*specs), Timings()


class _Entry(Entry):
    """The loaded programs of one `Exported`, in the shape of a `runtime.Entry` (so that
    `AOTFunction.__call__`, its `custom_vjp` rule and `fwd_and_bwd` run them)."""

    def __init__(self, meta: dict[str, Any], programs: dict[str, Any], consts: tuple[Any, ...]) -> None:
        fo = programs["forward_only"]
        consts_tree, args_tree, kwargs_tree = fo.in_tree.children()[0].children()
        self.owner = meta["name"]
        self.programs = programs
        self.fwd = _Forward(consts, tuple(fo.in_avals), tuple(fo.out_avals), fo.out_tree)
        self.in_tree = _tuple_tree(args_tree, kwargs_tree)
        self.arg_positions = tuple(meta["arg_positions"])
        self.leaf_args = tuple(meta["leaf_args"])
        self.options = meta["config"]
        self.strategy = meta["report"]["partitioner"]
        self.exported_perturbed = tuple(meta["perturbed"])
        self.exported_has_ct = tuple(meta["has_ct"])
        self.saved_inputs = tuple(meta["saved_inputs"])
        fo_args = _tuple_tree(consts_tree, args_tree, kwargs_tree)
        self.forward_only = jax.jit(lambda *flat: tree_leaves(fo.call(*tree_unflatten(fo_args, flat))))
        self.forward = jax.jit(programs["forward"].call)
        self.backward = jax.jit(programs["backward"].call)
        self.pairs: dict[tuple[tuple[bool, ...], tuple[bool, ...]], _Pair] = {}
        self.plans: dict[object, Any] = {}
        self.hooks = self.layout = None  # the backward is the exported program: no hooks
        self.paths = leaf_paths(_spec_of(meta), self.in_tree)
        self.call = self._differentiable()

    def pair(self, perturbed: tuple[bool, ...], has_ct: tuple[bool, ...]) -> _Pair:  # type: ignore[override]
        key = (perturbed, has_ct)
        pair = self.pairs.get(key)
        if pair is None:
            n = len(self.fwd.consts)
            extra = [self.paths[i - n] for i, (p, q) in enumerate(zip(perturbed, self.exported_perturbed, strict=True))
                     if p and not q and i >= n]
            if extra:
                have = [self.paths[i - n] for i, q in enumerate(self.exported_perturbed) if q and i >= n]
                raise ExportError(
                    f"aotgrad.Exported({self.owner}): a gradient was asked for argument(s) "
                    f"{', '.join(extra)}, which the export does not differentiate (it differentiates "
                    f"{', '.join(have) or 'nothing'}). Export again with argnums naming them.")
            pair = _Pair(self, perturbed, tuple(h and e for h, e in zip(has_ct, self.exported_has_ct, strict=True)))
            self.pairs[key] = pair
        return pair


def _tuple_tree(*trees: Any) -> Any:
    """The structure of a tuple of these structures (in the default pytree registry)."""
    return tree_structure(tuple(tree_unflatten(t, [0] * t.num_leaves) for t in trees))


def _spec_of(meta: dict[str, Any]) -> ArgSpec:
    return ArgSpec(meta["name"], tuple(meta["static_argnums"]), tuple(meta["static_argnames"]),
                   tuple(meta["param_names"]), meta["python_scalars"])


class Exported(AOTFunction):
    """A forward/backward pair exported by `aotgrad.export` or loaded by `aotgrad.deserialize`.

    Call it and differentiate it like the `aotgrad.compile`d function it came from (eager,
    `jax.jit`, `jax.grad`, `jax.vjp`, `aotgrad.fwd_and_bwd`, `aotgrad.explain`), with
    arguments of the exported structure, shapes and dtypes (and the same static values).
    Its programs are fixed: `aotgrad.config` options that change programs do not apply to
    them; `.config` and `.autocast` tell what they were built under.
    """

    def __init__(self, meta: dict[str, Any], programs: dict[str, Any], consts: tuple[Any, ...]) -> None:
        self._meta = meta
        self._programs = programs
        self._spec = _spec_of(meta)
        self._static = tuple((k, decode_static(v)) for k, v in meta["static"])
        self._entry = _Entry(meta, programs, consts)
        self._nnx = False  # its arguments are the exported leaves: no graph nodes to split
        self.__name__ = self.__qualname__ = self._spec.fn_name
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
        return self._entry.in_tree

    @property
    def in_avals(self) -> tuple[Any, ...]:
        """The type of each argument leaf (closed-over values excluded)."""
        return self._entry.fwd.in_avals[len(self._entry.fwd.consts):]

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
                raise ExportError(f"aotgrad.Exported({self.name}).serialize needs the 'flatbuffers' "
                                  f"package (pip install 'aotgrad[export]'): {e}") from e
        consts = []
        for i, c in enumerate(self._entry.fwd.consts):
            if jax.dtypes.issubdtype(c.dtype, jax.dtypes.extended):
                raise ExportError(f"aotgrad.Exported({self.name}).serialize: closed-over value {i} is "
                                  f"a {c.dtype} array, which cannot be stored; pass it as an argument.")
            data = np.ascontiguousarray(jax.device_get(c))
            sections[f"const{i}"] = data.tobytes()
            consts.append({"dtype": np.dtype(data.dtype).name, "shape": list(data.shape)})
        return pack({**self._meta, "consts": consts}, sections)

    # ---------------------------------------------------------------- calling

    def _resolve(self, args: tuple, kwargs: dict) -> _Call:
        ensure_compilation_cache()
        static, dyn_args, dyn_kwargs = self._spec.split(args, kwargs)
        if static != self._static:
            raise ExportError(f"aotgrad.Exported({self.name}): static arguments {dict(static)} differ "
                              f"from those it was exported with, {dict(self._static)}; export again "
                              f"for these values.")
        leaves, in_tree = self._spec.flatten(dyn_args, dyn_kwargs)
        entry = self._entry
        if in_tree != entry.in_tree:
            raise ExportError(f"aotgrad.Exported({self.name}): the arguments have structure {in_tree}; "
                              f"it was exported for {entry.in_tree}. Call it with arguments of that "
                              f"structure, or export again for this one.")
        for path, leaf, want in zip(entry.paths, leaves, self.in_avals, strict=True):
            got = jax.typeof(leaf) if not isinstance(leaf, jax.ShapeDtypeStruct) else leaf
            if got.dtype != want.dtype or not _fits(got.shape, want.shape):
                raise ExportError(
                    f"aotgrad.Exported({self.name}): argument {path} is {_text(got)}; it was exported "
                    f"for {_text(want)}. Call it with that shape and dtype, or export again (with "
                    f"jax.export.symbolic_shape dimensions for sizes that vary).")
        return _Call(entry, (*entry.fwd.consts, *leaves))

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lowers the exported forward and backward programs for these arguments."""
        call = self._resolve(args, kwargs)
        pair = call.entry.pair(call.entry.exported_perturbed, call.entry.exported_has_ct)
        return Lowered(self.name, pair, *pair.lower(call.inputs))  # type: ignore[arg-type]

    def explain(self, *args: Any, argnums: int | Sequence[int] | None = None, **kwargs: Any) -> Report:
        """The report made when it was exported (saved values with their source lines,
        recomputed primitives, casts), with XLA's memory analysis of the loaded programs."""
        if argnums is not None:
            who = f"aotgrad.explain({self.name})"
            positions = argnum_positions(who, argnums, len(args))
            asked = self._entry.perturbed_for(positions)
            if asked != self._entry.exported_perturbed:
                raise ExportError(f"aotgrad.explain({self.name}): argnums={argnums} differentiates other "
                                  f"inputs than the exported programs; explain it without argnums.")
        call = self._resolve(args, kwargs)
        entry = self._entry
        results = jax.eval_shape(entry.forward, *call.inputs)  # binds symbolic dimensions
        avals = [*results[len(entry.fwd.out_avals):], *(call.inputs[i] for i in entry.saved_inputs)]
        if not all(concrete(a.shape) for a in avals):
            raise ExportError(f"aotgrad.explain({self.name}): the export has symbolic dimensions; "
                              f"explain it for arrays (or ShapeDtypeStructs) of concrete shapes.")
        compiled = self.lower(*args, **kwargs).compile()
        jaxprs = {name: jax.make_jaxpr(self._programs[name].call)(*self._programs[name].in_avals)
                  for name in ("forward", "backward")}
        return _report_of(self.name, self._meta["report"], avals, Memory.of(compiled), jaxprs,
                          compiled.timings.compile)

    def cache_info(self) -> CacheInfo:
        return CacheInfo(1, len(self._entry.pairs), 0, 0)

    def register_prehook(self, fn: Callable[[Any], Any]) -> Any:
        """Not supported: the backward is the exported program (raises `ExportError`)."""
        raise ExportError(_NO_HOOKS.format(name=self.name))

    def register_hook(self, fn: Callable[..., Any], per_leaf: bool = False) -> Any:
        """Not supported: the backward is the exported program (raises `ExportError`)."""
        raise ExportError(_NO_HOOKS.format(name=self.name))

    def clear_cache(self) -> None:
        """Nothing to clear: the programs are the export."""

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
        raise ExportError(f"aotgrad.deserialize needs the 'flatbuffers' package "
                          f"(pip install 'aotgrad[export]'): {e}") from e
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
