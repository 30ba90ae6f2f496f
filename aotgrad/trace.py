"""How the graph is traced: the forward function once per signature, then the joint graph
(forward and VJP together) once per choice of differentiated inputs. The autocast rewrite
of the forward is applied above this module (`pipeline.trace_forward`)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.extend.core.primitives as P
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn
from jax.tree_util import tree_flatten

from aotgrad._jax_internals import INLINE_WHEN_STAGED, bind_eqn, source_line
from aotgrad.devices import DeviceProfile, device_count_of
from aotgrad.interpret import INLINE_RULES, Rule, eval_jaxpr, inlining, sub_jaxprs
from aotgrad.partition.graph import JointGraph
from aotgrad.partition.shards import Split, input_splits
from aotgrad.provenance import numbered
from aotgrad.signature import check_output_leaves

if TYPE_CHECKING:
    from aotgrad.autocast.context import Setting

__all__ = ["ForwardTrace", "differentiable", "input_layout", "trace_body_joint", "trace_forward", "trace_joint"]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ForwardTrace:
    """`fn` traced once; its closed-over arrays are treated as leading inputs, so that
    gradients reach them and cached programs never embed them."""
    jaxpr: ClosedJaxpr  # leaves -> flat outputs, closing over `consts`
    consts: tuple[Any, ...]  # closed-over arrays (possibly tracers of an enclosing transform)
    in_avals: tuple[Any, ...]  # of (consts..., leaves...)
    out_tree: Any
    autocast: Setting | None = None  # the autocast setting it was traced under
    casts: tuple[tuple[str, int], ...] = ()  # casts the autocast rewrite inserted, by policy

    @property
    def out_avals(self) -> tuple[Any, ...]:
        return tuple(self.jaxpr.out_avals)

    def __repr__(self) -> str:  # short: the default printed the whole jaxpr
        return (f"ForwardTrace({len(self.jaxpr.jaxpr.eqns)} equations, {len(self.in_avals)} inputs, "
                f"{len(self.jaxpr.out_avals)} outputs)")

    def __call__(self, *inputs: Any, rules: dict | None = None, number: bool = False,
                 bind: Rule = bind_eqn) -> list[Any]:
        """(consts..., leaves...) -> flat outputs; `rules` and `bind` as in
        `interpret.eval_jaxpr`. `number`: bind each equation under its sequence number
        (`provenance`)."""
        n = len(self.consts)
        if number:
            rules, bind = numbered(self.jaxpr.jaxpr, rules, bind)
        return eval_jaxpr(self.jaxpr.jaxpr, inputs[:n], inputs[n:], rules, bind=bind)


def trace_forward(flat_fn: Callable[..., Any], fn_name: str, avals: Sequence[Any],
                  rewrite: Callable[[ClosedJaxpr], tuple[ClosedJaxpr, tuple[tuple[str, int], ...]]] | None = None,
                  autocast: Setting | None = None) -> ForwardTrace:
    """Traces `flat_fn(*leaves) -> pytree` once; hoists its closed-over arrays to inputs.
    `rewrite(closed) -> (closed, casts)`, when given, rewrites the trace before its
    constants are hoisted (the autocast rewrite, `pipeline.trace_forward`), so the
    forward-only program and the joint graph both see the casts."""
    out_tree_box = []

    def flat_out(*leaves: Any) -> list[Any]:
        out = flat_fn(*leaves)
        check_output_leaves(fn_name, out)
        flat, tree = tree_flatten(out)
        out_tree_box.append(tree)
        return flat

    closed = jax.make_jaxpr(flat_out)(*avals)
    casts: tuple[tuple[str, int], ...] = ()
    if rewrite is not None:
        closed, casts = rewrite(closed)
    consts = tuple(closed.consts)
    in_avals = tuple(jax.typeof(c) for c in consts) + tuple(avals)
    return ForwardTrace(closed, consts, in_avals, out_tree_box[0], autocast, casts)


def differentiable(aval: Any) -> bool:
    """Values of inexact (floating or complex) dtype carry cotangents."""
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def trace_joint(fwd: ForwardTrace, perturbed: Sequence[bool], has_ct: Sequence[bool],
                rules: dict | None = None, device: DeviceProfile | None = None,
                staged: bool = False, keep_names: bool = False) -> JointGraph:
    """Traces (inputs..., cotangents...) -> (outputs..., cotangents of perturbed inputs...).

    `perturbed[i]`: input i is differentiated. `has_ct[j]`: output j receives a cotangent
    (the others, integer outputs and auxiliary data, get zero cotangents). `rules`
    re-bind forward equations before differentiation (scan bodies cut on their own,
    `partition.scan`). Every equation carries the sequence number of the forward
    equation it comes from (`provenance`). `device` and `staged`: what the programs are
    built for and whether they run as one (`JointGraph`). Nested `jit` / `closed_call`s
    are inlined, so the partitioner sees every primitive: the forward's as they are
    differentiated, and any a derivative rule makes by a second pass. `checkpoint_name`s
    outside the user's own `jax.checkpoint` regions are dropped unless `keep_names`: XLA
    computes nothing for them (no policy reads them there), and as equations of their own
    they made the estimates write a value XLA:GPU computes in its readers, and the cut price
    saving a name apart from its value.
    """
    in_avals = list(fwd.in_avals)
    diff_pos = [i for i, p in enumerate(perturbed) if p]
    ct_pos = [j for j, c in enumerate(has_ct) if c]
    ct_avals = [fwd.out_avals[j].strip_weak_type() for j in ct_pos]
    base = INLINE_RULES if keep_names else _UNNAMED_INLINE
    inline = {**base, **(rules or {})}

    def joint(*args: Any) -> tuple[list[Any], list[Any]]:
        inputs, cts = list(args[:len(in_avals)]), args[len(in_avals):]

        def f(*diff: Any) -> list[Any]:
            full = list(inputs)
            for i, d in zip(diff_pos, diff):
                full[i] = d
            return fwd(*full, rules=inline, number=True, bind=_Repeated())

        outs, vjp = jax.vjp(f, *[inputs[i] for i in diff_pos])
        full_cts = [_zero_cotangent(a) for a in fwd.out_avals]
        for j, ct in zip(ct_pos, cts):
            full_cts[j] = ct
        return outs, list(vjp(full_cts))

    closed = jax.make_jaxpr(joint)(*in_avals, *ct_avals)
    if any(e.primitive in base for e in closed.jaxpr.eqns):  # a derivative rule's call (or name)
        closed = jax.make_jaxpr(lambda *xs: eval_jaxpr(closed.jaxpr, closed.consts, xs, base))(
            *in_avals, *ct_avals)
    devices, splits = input_layout(in_avals, perturbed)
    return JointGraph(closed, n_inputs=len(in_avals), n_outs=len(fwd.out_avals), device=device,
                      staged=staged, devices=devices, input_splits=splits)


def _unnamed(eqn: Any, invals: list) -> list:  # a `checkpoint_name` is its operand
    return invals


_UNNAMED_INLINE = inlining({P.name_p: _unnamed})


class _Repeated:
    """Binds forward equations through one inlined `jax.jit` call per distinct primitive,
    parameters, operand types, context and source line. JAX differentiates a jitted call
    once per distinct body (it keeps the derivative of each jaxpr it has seen), so what a
    deep model repeats layer after layer is differentiated once, not once per layer. The
    calls are inlined where they are staged: the joint graph holds the same equations,
    under the same names and source lines, either way. Equations with effects or bodies
    (scans, calls, custom derivatives) are bound as they are."""

    def __init__(self) -> None:
        self.calls: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, eqn: JaxprEqn, invals: list) -> list:
        if eqn.effects or sub_jaxprs(eqn):
            return bind_eqn(eqn, invals)
        key = (eqn.primitive, tuple(eqn.params.items()), tuple(map(jax.typeof, invals)), eqn.ctx, source_line(eqn))
        try:
            call = self.calls.get(key)
        except TypeError:  # a parameter that cannot be hashed
            return bind_eqn(eqn, invals)
        if call is None:
            call = self.calls[key] = jax.jit(_binder(eqn), inline=INLINE_WHEN_STAGED)
        return bind_eqn(eqn, invals, call)


def _binder(eqn: JaxprEqn) -> Callable[..., Any]:
    primitive, params = eqn.primitive, eqn.primitive.get_bind_params(eqn.params)

    def bind(*args: Any) -> Any:
        return primitive.bind(*args, **params)
    return bind


def input_layout(in_avals: Sequence[Any], perturbed: Sequence[bool]) -> tuple[int, tuple[Split | None, ...]]:
    """How many devices a step's inputs are split over, and each input's split
    (`shards.input_splits`)."""
    devices = device_count_of(in_avals)
    return devices, input_splits(in_avals, perturbed, devices)


def trace_body_joint(closed: ClosedJaxpr, avals: Sequence[Any], splits: Sequence[Split | None] = (),
                     device: DeviceProfile | None = None, devices: int = 1) -> JointGraph:
    """The joint graph of `closed` (no hoisted constants; inputs of `avals`: a scan body,
    `partition.scan`), every inexact input differentiated and every inexact output given
    a cotangent; `device`: the step's, which the body is priced for; `splits`: each
    input's split over the step's `devices` (`shards`: the body's bytes per device)."""
    fwd = ForwardTrace(closed, (), tuple(avals), None)
    graph = trace_joint(fwd, tuple(map(differentiable, avals)), tuple(map(differentiable, closed.out_avals)),
                        device=device, keep_names=True)
    return dataclasses.replace(graph, devices=devices, input_splits=tuple(splits))


def _zero_cotangent(aval: Any) -> Any:
    if differentiable(aval):
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)
