"""A grammar of small JAX programs for differential fuzzing (tests/test_fuzz.py).

A `Program` is a list of `Step`s over rank-2 values: inputs first, then each step's result.
Every step names an operation from `OPS`, the values it reads, and its static parameters;
`Program.fn` turns it into an ordinary JAX function, and `repr(program)` is Python that
rebuilds it, so a failing example becomes a regression test by copy and paste.

Shapes are tracked while drawing, so every program traces. Unbounded operations are applied
to bounded inputs (`tanh`, `x / (1 + x^2)`), so values stay finite for any input.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

Shape = tuple[int, int]


def _no_param(*shapes: Shape) -> Any:
    return st.just(None)


@dataclasses.dataclass(frozen=True)
class Op:
    arity: int
    shape: Callable[..., Shape | None]  # (operand shapes..., param) -> result shape, None: not applicable
    apply: Callable[..., Any]  # (operands..., param) -> result
    params: Callable[..., Any] = _no_param  # shapes -> strategy of the param


def _same(*shapes: Shape) -> Shape:
    return shapes[0]


def _pointwise(f: Callable[[Any], Any]) -> Op:
    return Op(1, lambda s, p: s, lambda x, p: f(x))


def _binary(f: Callable[[Any, Any], Any]) -> Op:
    # the second operand has the first's shape, or broadcasts to it: (1, c), (r, 1), (1, 1)
    def shape(a: Shape, b: Shape, p: Any) -> Shape | None:
        ok = all(db in (1, da) for da, db in zip(a, b))
        return a if ok else None
    return Op(2, shape, lambda x, y, p: f(x, y))


def _reduce(f: Callable[..., Any]) -> Op:
    return Op(1, lambda s, axis: (1, s[1]) if axis == 0 else (s[0], 1),
              lambda x, axis: f(x, axis=axis, keepdims=True), lambda s: st.sampled_from([0, 1]))


def _scan_rows(x: Any, p: Any) -> Any:
    def step(carry: Any, row: Any) -> tuple[Any, Any]:
        carry = jnp.tanh(carry * 0.9 + row)
        return carry, carry * row
    _, ys = lax.scan(step, x[0], x)
    return ys


def _fori(x: Any, p: Any) -> Any:
    return lax.fori_loop(0, 3, lambda i, a: jnp.sin(a) * 0.9 + 0.1 * i, x)  # static bounds: a scan


def _while_scale(x: Any, p: Any) -> Any:
    """A while loop on a value without a gradient, scaling a differentiated one."""
    def body(c: tuple[Any, Any]) -> tuple[Any, Any]:
        return c[0] + 1, c[1] * 0.5 + 0.25
    _, k = lax.while_loop(lambda c: c[0] < 3, body, (0, lax.stop_gradient(jnp.tanh(jnp.sum(x)))))
    return x * (1.0 + k)


def _cond(x: Any, p: Any) -> Any:
    return lax.cond(jnp.sum(x) > 0, lambda a: jnp.sin(a) * 2.0, lambda a: jnp.tanh(a) - a * a, x)


def _gather(x: Any, idx: tuple[int, ...]) -> Any:
    return x[jnp.array(idx, jnp.int32)]


def _scatter_add(x: Any, idx: tuple[int, ...]) -> Any:
    rows = jnp.array(idx, jnp.int32)
    return x.at[rows].add(jnp.sin(x[rows]))


@jax.custom_vjp
def _matmul_rule(x: Any, y: Any) -> Any:
    return x @ y.T


def _matmul_rule_fwd(x: Any, y: Any) -> tuple[Any, Any]:
    return x @ y.T, (x, y)


def _matmul_rule_bwd(res: Any, g: Any) -> tuple[Any, Any]:
    """Its own matmuls of the cotangent: what `backward_pass_autocast` decides the type of."""
    x, y = res
    return g @ y, g.T @ x


_matmul_rule.defvjp(_matmul_rule_fwd, _matmul_rule_bwd)


def _indices(s: Shape) -> Any:
    return st.lists(st.integers(0, s[0] - 1), min_size=1, max_size=4).map(tuple)


OPS: dict[str, Op] = {
    # pointwise
    "sin": _pointwise(jnp.sin),
    "tanh": _pointwise(jnp.tanh),
    "sigmoid": _pointwise(jax.nn.sigmoid),
    "softsign": _pointwise(lambda x: x / (1.0 + jnp.abs(x))),
    "square_bounded": _pointwise(lambda x: jnp.tanh(x) ** 2),
    "exp_bounded": _pointwise(lambda x: jnp.exp(jnp.tanh(x))),
    "log1p_square": _pointwise(lambda x: jnp.log1p(x * x)),
    "sqrt_1p_square": _pointwise(lambda x: jnp.sqrt(1.0 + x * x)),
    "gelu": _pointwise(jax.nn.gelu),
    "relu": _pointwise(jax.nn.relu),
    "silu": _pointwise(jax.nn.silu),
    "softplus": _pointwise(jax.nn.softplus),
    "erf": _pointwise(lax.erf),
    "inv_square": _pointwise(lambda x: (1.0 + x * x) ** -2),  # integer_pow, negative exponent
    "pow_bounded": _pointwise(lambda x: (1.0 + x * x) ** 0.75),  # pow
    "checkpointed": _pointwise(jax.checkpoint(lambda x: jnp.sin(jnp.cos(x)) * x)),
    "add": _binary(jnp.add),
    "sub": _binary(jnp.subtract),
    "mul": _binary(jnp.multiply),
    "div_safe": _binary(lambda x, y: x / (1.0 + y * y)),
    "maximum": _binary(jnp.maximum),
    "where_greater": _binary(lambda x, y: jnp.where(x > y, x, 0.5 * y)),
    # reductions (keepdims: values stay rank 2)
    "sum": _reduce(jnp.sum),
    "mean": _reduce(jnp.mean),
    "max": _reduce(jnp.max),
    "logsumexp": _reduce(jax.nn.logsumexp),
    "prod_bounded": _reduce(lambda x, axis, keepdims: jnp.prod(1.0 + 0.1 * jnp.tanh(x), axis, keepdims=keepdims)),
    "rms_norm": Op(1, lambda s, axis: s, lambda x, axis: x * lax.rsqrt(jnp.mean(x * x, axis, keepdims=True) + 0.1),
                   lambda s: st.sampled_from([0, 1])),
    "softmax": Op(1, lambda s, axis: s, lambda x, axis: jax.nn.softmax(x, axis=axis),
                  lambda s: st.sampled_from([0, 1])),
    "cumsum": Op(1, lambda s, axis: s, lambda x, axis: jnp.cumsum(x, axis=axis), lambda s: st.sampled_from([0, 1])),
    "sort": Op(1, lambda s, axis: s, lambda x, axis: jnp.sort(x, axis=axis), lambda s: st.sampled_from([0, 1])),
    # matmuls
    "matmul_nt": Op(2, lambda a, b, p: (a[0], b[0]) if a[1] == b[1] else None, lambda x, y, p: x @ y.T),
    "matmul_tn": Op(2, lambda a, b, p: (a[1], b[1]) if a[0] == b[0] else None, lambda x, y, p: x.T @ y),
    "matmul_rule": Op(2, lambda a, b, p: (a[0], b[0]) if a[1] == b[1] else None,
                      lambda x, y, p: _matmul_rule(x, y)),  # a custom_vjp with its own matmul backward
    "rowdot": Op(2, lambda a, b, p: (a[0], 1) if a == b else None,
                 lambda x, y, p: jnp.einsum("ij,ij->i", x, y)[:, None]),
    # shapes
    "transpose": Op(1, lambda s, p: (s[1], s[0]), lambda x, p: x.T),
    "reshape_swap": Op(1, lambda s, p: (s[1], s[0]), lambda x, p: x.reshape(x.shape[1], x.shape[0])),
    "flip": Op(1, lambda s, axis: s, lambda x, axis: jnp.flip(x, axis), lambda s: st.sampled_from([0, 1])),
    "concat_rows": Op(2, lambda a, b, p: (a[0] + b[0], a[1]) if a[1] == b[1] else None,
                      lambda x, y, p: jnp.concatenate([x, y], axis=0)),
    "drop_first_row": Op(1, lambda s, p: (s[0] - 1, s[1]) if s[0] > 1 else None, lambda x, p: x[1:]),
    "pad": Op(1, lambda s, p: (s[0] + 1, s[1] + 2), lambda x, p: jnp.pad(x, ((1, 0), (1, 1)))),
    # indexing
    "gather_rows": Op(1, lambda s, idx: (len(idx), s[1]), _gather, _indices),
    "scatter_add_rows": Op(1, lambda s, idx: s, _scatter_add, _indices),
    "dynamic_slice": Op(1, lambda s, i: (1, s[1]), lambda x, i: lax.dynamic_slice(x, (i, 0), (1, x.shape[1])),
                        lambda s: st.integers(0, s[0] - 1)),
    # control flow
    "cond": Op(1, lambda s, p: s, _cond),
    "scan_rows": Op(1, lambda s, p: s, _scan_rows),
    "fori_loop": Op(1, lambda s, p: s, _fori),
    "while_scale": Op(1, lambda s, p: s, _while_scale),
}


@dataclasses.dataclass(frozen=True)
class Step:
    op: str
    args: tuple[int, ...]  # indices of the values read (inputs first, then step results)
    param: Any = None


@dataclasses.dataclass(frozen=True)
class Program:
    inputs: tuple[Shape, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]  # indices of the values returned
    dtype: str = "float32"

    def fn(self) -> Callable[..., Any]:
        def program(*inputs: Any) -> Any:
            values = list(inputs)
            for s in self.steps:
                values.append(OPS[s.op].apply(*[values[i] for i in s.args], s.param))
            outs = tuple(values[i] for i in self.outputs)
            return outs[0] if len(outs) == 1 else outs
        return program

    def args(self, seed: int) -> list[Any]:
        rng = np.random.default_rng(seed)
        return [jnp.asarray(rng.standard_normal(s), self.dtype) for s in self.inputs]

    def __repr__(self) -> str:
        steps = ", ".join(f"Step({s.op!r}, {s.args}, {s.param!r})" for s in self.steps)
        return (f"Program(inputs={self.inputs}, steps=({steps}{',' if len(self.steps) == 1 else ''}), "
                f"outputs={self.outputs}, dtype={self.dtype!r})")


MATMULS = ("matmul_nt", "matmul_tn", "matmul_rule", "rowdot")


# ----------------------------------------------------------------------------- every production, fixed
# CI's fixed slice draws few random programs; these programs apply every op (with every
# value of a parameter that picks a code path: both axes) at least once, whatever the draws.

_AXIS_OPS = ("sum", "mean", "max", "logsumexp", "prod_bounded", "rms_norm", "softmax", "cumsum", "sort", "flip")
FIXED_PARAMS: dict[str, Callable[[Shape], tuple[Any, ...]]] = {
    **{name: lambda s: (0, 1) for name in _AXIS_OPS},
    "gather_rows": lambda s: ((s[0] - 1, 0, s[0] - 1),),  # a repeated row
    "scatter_add_rows": lambda s: ((0, s[0] - 1, 0),),  # a repeated row: added twice
    "dynamic_slice": lambda s: (s[0] - 1,),
}


def covering_programs(ops: Sequence[str] = tuple(OPS), first: str | None = None, steps: int = 8,
                      dtype: str = "float32") -> list[Program]:
    """Programs that together apply every op of `ops` (sorted), each with every parameter
    of `FIXED_PARAMS`, `steps` steps per program (after `first`: an op every program starts
    with, a matmul for autocast). Inputs (3, 4), (1, 4), (4, 4). A step reads the latest value
    of at least 2 x 2 where its shape allows, else the first input; a binary op's second
    operand gives the largest result, then one of another shape (broadcasting). Every value no
    later step reads is an output, so every step gets a cotangent."""
    plan = [(name, param) for name in sorted(ops) for param in _fixed(name, (3, 4))]
    chunks = [plan[i:i + steps] for i in range(0, len(plan), steps)]
    return [_chain([(first, None)] + chunk if first else chunk, dtype) for chunk in chunks]


def _fixed(name: str, shape: Shape) -> tuple[Any, ...]:
    if name in FIXED_PARAMS:
        return FIXED_PARAMS[name](shape)
    if OPS[name].params is not _no_param:
        raise ValueError(f"covering_programs: op {name!r} draws a parameter; give it FIXED_PARAMS")
    return (None,)


def _chain(plan: list[tuple[str, Any]], dtype: str) -> Program:
    inputs: tuple[Shape, ...] = ((3, 4), (1, 4), (4, 4))
    shapes = list(inputs)
    out: list[Step] = []
    for name, param in plan:
        op = OPS[name]
        wide = [i for i, s in enumerate(shapes) if min(s) >= 2]
        for first in (wide[-1], 0):  # the latest value of at least 2 x 2, else the first input
            operands = [first]
            if op.arity == 2:
                fits = [i for i, s in enumerate(shapes) if op.shape(shapes[first], s, None) is not None]
                if not fits:
                    continue
                # the largest result (a matmul's result stays 2-D), then broadcasting, then the latest
                size = lambda i: np.prod(op.shape(shapes[first], shapes[i], None))  # noqa: E731
                operands.append(max(fits, key=lambda i: (size(i), shapes[i] != shapes[first], i)))
            # axes as planned; row indices valid for this operand
            p = param if name in _AXIS_OPS or param is None else _fixed(name, shapes[first])[0]
            shape = op.shape(*[shapes[i] for i in operands], p)
            if shape is not None and min(shape) >= 1 and max(shape) <= 12:
                out.append(Step(name, tuple(operands), p))
                shapes.append(shape)
                break
        else:
            raise ValueError(f"covering_programs: {name} applies to neither the latest value nor the first input")
    read = {i for step in out for i in step.args}
    outputs = tuple(i for i in range(len(inputs), len(shapes)) if i not in read)
    return Program(inputs, tuple(out), outputs, dtype)


# ----------------------------------------------------------------------------- a hand-written oracle
# For a subset of the ops, the mixed-precision program written out with explicit casts: what
# each op computes under autocast(device_type, dtype), from the policy tables as documented
# (docs/autocast.md), not from aotgrad's rewrite. Binary ops rely on JAX's own promotion
# (the join of the types).

def _lower(x: Any, y: Any, dtype: Any, transpose_first: bool) -> Any:
    a, b = (x.T, y) if transpose_first else (x, y.T)
    return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=dtype)


def _fp32_on_gpu(f: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
    """An op on the gpu table's fp32 list and on no cpu list."""
    return lambda x, device: f(x.astype(jnp.float32)) if device == "gpu" else f(x)


_EXP, _LOG1P = _fp32_on_gpu(jnp.exp), _fp32_on_gpu(jnp.log1p)
HAND_WRITTEN: dict[str, Callable[..., Any]] = {
    # (operands..., param, device, dtype) -> result
    "matmul_nt": lambda x, y, p, device, dtype: _lower(x, y, dtype, False),
    "matmul_tn": lambda x, y, p, device, dtype: _lower(x, y, dtype, True),
    "sin": lambda x, p, device, dtype: jnp.sin(x),
    "tanh": lambda x, p, device, dtype: jnp.tanh(x),
    "exp_bounded": lambda x, p, device, dtype: _EXP(jnp.tanh(x), device),
    "log1p_square": lambda x, p, device, dtype: _LOG1P(x * x, device),
    "add": lambda x, y, p, device, dtype: x + y,
    "sub": lambda x, y, p, device, dtype: x - y,
    "mul": lambda x, y, p, device, dtype: x * y,
    # reduce_sum is on the gpu table's fp32 list (a float32 result); on cpu its 16-bit input
    # accumulates in float32 and the result keeps the input's type, as jnp.sum does
    "sum": lambda x, axis, device, dtype: _fp32_on_gpu(lambda v: jnp.sum(v, axis=axis, keepdims=True))(x, device),
    "transpose": lambda x, p, device, dtype: x.T,
}


# Which results are float32 because a table made them so (docs/autocast.md, "Promotion"):
# the gpu table's fp32 ops. Under the "jax" promotion only such a value, or one computed
# from it, wins over a 16-bit operand; the inputs and what is computed from them alone follow.
_WIDE_ON_GPU = frozenset({"exp_bounded", "log1p_square", "sum"})
_HALF = frozenset({jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)})


def hand_written(program: "Program", device: str, dtype: str, promotion: str = "jax") -> Callable[..., Any]:
    """`program` under `autocast(device, dtype, promotion=promotion)`, from `HAND_WRITTEN`
    (its ops only)."""
    def run(*inputs: Any) -> Any:
        values, wide = list(inputs), [False] * len(inputs)
        for s in program.steps:
            args, flags = [values[i] for i in s.args], [wide[i] for i in s.args]
            dtypes = {a.dtype for a in args}
            if promotion == "jax" and len(dtypes) > 1 and dtypes & _HALF and not any(
                    f and a.dtype == jnp.float32 for a, f in zip(args, flags)):
                half = next(d for d in dtypes if d in _HALF)  # a float32 input follows
                args = [a.astype(half) if a.dtype == jnp.float32 else a for a in args]
            out = HAND_WRITTEN[s.op](*args, s.param, device, jnp.dtype(dtype))
            mixed = any(a.dtype in _HALF for a in args) and out.dtype == jnp.float32
            values.append(out)
            wide.append(out.dtype == jnp.float32 and (any(flags) or mixed
                                                      or (device == "gpu" and s.op in _WIDE_ON_GPU)))
        outs = tuple(values[i] for i in program.outputs)
        return outs[0] if len(outs) == 1 else outs
    return run


@st.composite
def programs(draw: Any, max_steps: int = 6, dtypes: tuple[str, ...] = ("float32",),
             first_ops: tuple[str, ...] = (), chain: bool = False, ops: tuple[str, ...] = ()) -> Program:
    """Random well-shaped programs: 1-3 inputs of shape (1..4, 1..4), 1..max_steps steps.
    `first_ops`: the ops the first step is drawn from (default: all). `chain`: a step reads
    the latest value first three times in four (else any value), so that what the first
    step computes flows through the later ones. `ops`: the ops drawn from (default: all)."""
    dims = st.integers(1, 4)
    shapes: list[Shape] = [draw(st.tuples(dims, dims)) for _ in range(draw(st.integers(1, 3)))]
    n_inputs = len(shapes)
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        name = draw(st.sampled_from(sorted(first_ops if first_ops and not steps else ops or OPS)))
        op = OPS[name]
        latest = chain and draw(st.integers(0, 3)) > 0
        first = len(shapes) - 1 if latest else draw(st.integers(0, len(shapes) - 1))
        operands = [first]
        if op.arity == 2:
            fits = [i for i, s in enumerate(shapes) if op.shape(shapes[first], s, None) is not None]
            operands.append(draw(st.sampled_from(fits)) if fits else first)
            if op.shape(shapes[first], shapes[operands[1]], None) is None:
                continue  # not even x with itself (e.g. a matmul of a non-square with itself)
        param = draw(op.params(*[shapes[i] for i in operands]))
        shape = op.shape(*[shapes[i] for i in operands], param)
        if shape is None or min(shape) < 1 or max(shape) > 12:
            continue
        steps.append(Step(name, tuple(operands), param))
        shapes.append(shape)
    last = len(shapes) - 1
    extra = draw(st.lists(st.integers(0, last), max_size=1))
    dtype = draw(st.sampled_from(dtypes))
    return Program(tuple(shapes[:n_inputs]), tuple(steps), (last, *extra), dtype)
