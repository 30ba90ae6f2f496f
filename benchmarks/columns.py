"""The columns of the results tables, each with the one sentence that says what it is.

The terminal table (`report.format_table`), docs/results.md and the column legend in
docs/benchmarks.md are all made from these definitions, so a column's name, its cells and
its legend cannot drift apart. Also here: when a step-time ratio is inside the timing noise
(`~`), and which setting to pick for the lowest peak within 5% of the fused step's time.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Generic, Sequence, TypeVar

from benchmarks.measure import Stats
from benchmarks.overhead import TARGET_RATIO, OverheadRow
from benchmarks.records import Row
from benchmarks.targets import TargetRow

__all__ = ["Column", "MIXED_COLUMNS", "NOISE", "OVERHEAD_COLUMNS", "OVERHEAD_KEY", "Pick", "Refs", "SUITE_COLUMNS",
           "SUITE_KEY", "TARGET_COLUMNS", "TARGET_KEY", "TIME_SLACK", "by_workload", "hand_workload", "mixed_precision",
           "pick_suite", "pick_target", "suite_refs", "target_refs", "within_noise"]

R = TypeVar("R")
PEER = "jax_fwd_and_bwd"
TIME_SLACK = 1.05  # "within 5% of the fused step's time"
NOISE = "~"  # marks a step-time ratio whose difference from 1 is inside the timing noise


@dataclasses.dataclass(frozen=True)
class Refs(Generic[R]):
    """The rows a workload's other rows are compared with."""
    fused: R | None
    peer: R | None = None  # jax_fwd_and_bwd (the suite only)
    hand: R | None = None  # the model written in 16 bits by hand, fused (a target's mixed-precision table)


@dataclasses.dataclass(frozen=True)
class Column(Generic[R]):
    """One column: its header (one or two lines), what it means, and its cell for a row."""
    head: tuple[str, ...]
    legend: str
    cell: Callable[[R, Refs[R]], str]

    @property
    def name(self) -> str:
        """The header on one line, as the docs and the legend name the column."""
        out = self.head[0]
        for prev, h in zip(self.head, self.head[1:]):
            glued = prev.endswith("/") and not prev.endswith(" /")  # "trace/part/" + "compile s"
            out += h if glued else " " + h
        return out


# ----------------------------------------------------------------------------- formatting

def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _giga(n: float | None) -> str:
    """Four significant digits: a small model's 0.09573 GB reads as well as GPT-2's 124.3."""
    return "-" if n is None else f"{n / 1e9:.4g}"


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "-" if a is None or not b else f"{a / b:.{digits}f}x"


def within_noise(a: Stats, b: Stats) -> bool:
    """Whether two runs' medians differ by no more than the wider of their interquartile
    ranges: a difference the timing noise alone could make."""
    return abs(a.median - b.median) <= max(a.iqr, b.iqr)


def _time_ratio(r: Row, ratio: float | None, ref: Row | None) -> str:
    if ratio is None:
        return "-"
    noisy = (ref is not None and ref is not r and r.step is not None and ref.step is not None
             and within_noise(r.step, ref.step))
    return f"{NOISE if noisy else ''}{ratio:.2f}x"


# ----------------------------------------------------------------------------- the suite's

def _peak(r: Row) -> int | None:
    return r.memory.peak if r.memory else None


def _jitted(r: Row) -> int | None:
    return r.memory.jitted_peak if r.memory else None


def _fwd_bwd(r: Row) -> str:
    m = r.memory
    if m is None or m.backward_peak is None:
        return "-"
    return f"{_mb(m.forward_peak)}/{_mb(m.backward_peak)}"


def _build(r: Row) -> str:
    b = r.build
    return "-" if b is None else f"{b.trace:.2f}/{b.partition:.2f}/{b.compile:.2f}"


SUITE_KEY = ("workload", "strategy")
# The first columns are the ones read at a glance; a narrow terminal wraps the rest.
SUITE_COLUMNS: tuple[Column[Row], ...] = (
    Column(("step", "ms"), "median time of one forward+backward step, over interleaved rounds of the "
           "same number of steps for every strategy", lambda r, _: f"{r.step.median * 1e3:.2f}" if r.step else "-"),
    Column(("IQR", "ms"), "interquartile range of those rounds' times per step (the timing noise)",
           lambda r, _: f"{r.step.iqr * 1e3:.2f}" if r.step else "-"),
    Column(("step /", "fused"), f"median step time over the fused step's; {NOISE} marks a difference inside "
           "the noise (the two medians differ by no more than the wider interquartile range)",
           lambda r, ref: _time_ratio(r, r.ratio_vs_fused, ref.fused)),
    Column(("step /", "jax"), f"median step time over jax.fwd_and_bwd's (the two-program peer); {NOISE} as above",
           lambda r, ref: _time_ratio(r, r.ratio_vs_jax, ref.peer)),
    Column(("peak (2 progs)", "/ fused"), "the step's peak memory as timed here, over the fused step's: for "
           "split strategies (jax_fwd_and_bwd, aotgrad) the larger of the forward and backward programs' peaks, "
           "run apart; for one-program strategies (fused, checkpoint:*) their own",
           lambda r, ref: _ratio(_peak(r), ref.fused and _peak(ref.fused))),
    Column(("peak (1 jit)", "/ fused"), "the peak of the same step inside one jax.jit(jax.value_and_grad(...)), as "
           "a training loop that jits its step runs it, over the fused step's (- for jax_fwd_and_bwd: jitted, "
           "it is fused)", lambda r, ref: _ratio(_jitted(r), ref.fused and _peak(ref.fused))),
    Column(("saved", "MB"), "activation bytes the forward keeps for the backward, inputs excluded "
           "(- for one-program strategies: nothing is kept between programs)",
           lambda r, _: _mb(r.saved.activations if r.saved else None)),
    Column(("inputs", "MB"), "bytes of inputs the forward hands to the backward (aotgrad passes the "
           "caller's own arrays; jax_fwd_and_bwd's are copies)", lambda r, _: _mb(r.saved.inputs if r.saved else None)),
    Column(("peak MB", "(2 progs)"), "the peak of 'peak (2 progs) / fused' in MB: XLA's memory_analysis(), "
           "arguments + outputs + scratch", lambda r, _: _mb(_peak(r))),
    Column(("fwd/bwd", "peak MB"), "the forward and the backward program's peaks, for split strategies",
           lambda r, _: _fwd_bwd(r)),
    Column(("grad", "err"), "largest over gradient leaves of max|g - g_ref| / max|g_ref| against float32 "
           "jax.jit(jax.grad(loss))", lambda r, _: "-" if r.grad_error is None else f"{r.grad_error:.1e}"),
    Column(("1st step", "s"), "wall time of the first call: tracing, partitioning, compiling, one step",
           lambda r, _: "-" if r.first_step_s is None else f"{r.first_step_s:.2f}"),
    Column(("trace/part/", "compile s"), "aotgrad only: seconds to trace the joint graph, to partition it, "
           "and to compile both programs", lambda r, _: _build(r)),
)

# ----------------------------------------------------------------------------- a target's

TARGET_KEY = ("workload", "strategy")
TARGET_COLUMNS: tuple[Column[TargetRow], ...] = (
    Column(("peak", "MB"), "the jitted step's peak memory per device: XLA's memory_analysis() "
           "(arguments + outputs + scratch) of the executable compiled for the target", lambda r, _: _mb(r.peak)),
    Column(("act", "MB"), "that peak minus the parameters and the batch on one device",
           lambda r, _: _mb(r.activation_peak)),
    Column(("act /", "fused"), "the activation peak over the fused step's",
           lambda r, ref: _ratio(r.activation_peak, ref.fused and ref.fused.activation_peak)),
    Column(("GB", "moved"), "bytes accessed by XLA's HLO cost analysis of the optimized module (on a GPU "
           "with its cuBLAS and cuDNN calls, which the analysis leaves out, counted from the module's text; "
           "each loop's body as often as it runs, where results before 2026-12-03 counted it once, as the "
           "analysis does), each asynchronous slice or in-place update at the bytes it moves: what step time "
           "followed on a real GPU",
           lambda r, _: _giga(r.bytes_moved)),
    Column(("moved /", "fused"), "bytes moved over the fused step's: the time proxy where nothing runs",
           lambda r, ref: _ratio(r.bytes_moved, ref.fused and ref.fused.bytes_moved)),
    Column(("GFLOP",), "floating-point operations by the same count, each loop's body as often as it runs",
           lambda r, _: _giga(r.flops)),
    Column(("compile", "s"), "seconds to trace, lower and compile the step on this machine",
           lambda r, _: f"{r.compile_seconds:.1f}"),
)


# ----------------------------------------------------------------------------- mixed precision

AUTOCAST = "autocast:"


def hand_workload(workload: str, strategy: str) -> str:
    """The workload that holds the hand-written 16-bit model an `autocast:<d>[@<budget>]` row
    of `workload` is compared with: `<workload>_<d>` (the suites name them so: `gpt_bf16` is
    `gpt` with dtype "bfloat16" in its sizes)."""
    short = strategy[len(AUTOCAST):].partition("@")[0]
    return f"{workload}_{short}"


def mixed_precision(rows: Sequence[TargetRow]) -> tuple[list[TargetRow], Callable[[TargetRow], Refs[TargetRow]]]:
    """A target's rows side by side per model: its float32 fused step, its hand-written
    16-bit model's rows (`<model>_bf16`, `<model>_fp16`; the fused step first, the anchor)
    and its autocast rows, for
    every model that has autocast rows or a hand-written bf16 model; and each row's
    references: the model's float32 fused step, and the hand-written model of the row's
    dtype (of the float32 row: the first autocast row's dtype, else bf16). Empty where the
    file has neither."""
    ok = {(r.workload, r.strategy): r for r in rows if r.error is None}
    out: list[TargetRow] = []
    refs: dict[int, Refs[TargetRow]] = {}
    for workload, mine in by_workload(rows).items():
        autocast = [r for r in mine if r.strategy.startswith(AUTOCAST)]
        hands = list(dict.fromkeys(hand_workload(workload, r.strategy) for r in autocast)) or [workload + "_bf16"]
        hand_rows = [r for h in hands for r in sorted((r for r in rows if r.workload == h),
                                                      key=lambda r: r.strategy != "fused")]
        if not autocast and not hand_rows:
            continue
        fused = ok.get((workload, "fused"))
        for r in [r for r in mine if r.strategy == "fused"] + hand_rows + autocast:
            hand = (r.workload if r in hand_rows else hand_workload(workload, r.strategy) if r in autocast
                    else hands[0])
            refs[id(r)] = Refs(fused, hand=ok.get((hand, "fused")))
            out.append(r)
    return out, lambda r: refs[id(r)]


MIXED_COLUMNS: tuple[Column[TargetRow], ...] = (
    Column(("act", "MB"), "the activation peak per device (the peak less the parameters and the batch)",
           lambda r, _: _mb(r.activation_peak)),
    Column(("GB", "moved"), "bytes moved (as in the table above)", lambda r, _: _giga(r.bytes_moved)),
    Column(("GFLOP",), "floating-point operations", lambda r, _: _giga(r.flops)),
    Column(("act /", "hand"), "the activation peak over the hand-written 16-bit model's (its fused step), to "
           "three decimals (as the next two)",
           lambda r, ref: _ratio(r.activation_peak, ref.hand and ref.hand.activation_peak, 3)),
    Column(("moved /", "hand"), "bytes moved over the hand-written 16-bit model's",
           lambda r, ref: _ratio(r.bytes_moved, ref.hand and ref.hand.bytes_moved, 3)),
    Column(("FLOP /", "hand"), "FLOPs over the hand-written 16-bit model's",
           lambda r, ref: _ratio(r.flops, ref.hand and ref.hand.flops, 3)),
    Column(("act /", "fp32"), "the activation peak over the float32 model's fused step",
           lambda r, ref: _ratio(r.activation_peak, ref.fused and ref.fused.activation_peak)),
)


# ----------------------------------------------------------------------------- call overhead

OVERHEAD_KEY = ("mode", "strategy")
OVERHEAD_COLUMNS: tuple[Column[OverheadRow], ...] = (
    Column(("us/call",), "median microseconds per forward+backward call of a 4x4 tanh(x @ w) loss: the host's "
           "cost per call (latency: waits for every call's gradients; dispatch: waits once, after the last)",
           lambda r, _: f"{r.per_call.median * 1e6:.1f}"),
    Column(("IQR us",), "interquartile range of the interleaved samples", lambda r, _: f"{r.per_call.iqr * 1e6:.1f}"),
    Column(("vs jax",), "median over jax.fwd_and_bwd's (the target: aotgrad within "
           f"{TARGET_RATIO}x)", lambda r, _: f"{r.ratio_vs_jax:.2f}x"),
    Column(("paired",), "median over rounds of this sample over jax.fwd_and_bwd's sample of the same round",
           lambda r, _: f"{r.paired_ratio_vs_jax:.2f}x"),
)


# ----------------------------------------------------------------------------- what to pick

@dataclasses.dataclass(frozen=True)
class Pick:
    """A workload's lowest-peak setting within `TIME_SLACK` of the fused step's time."""
    workload: str
    strategy: str
    peak_ratio: float  # the chosen step's peak over the fused step's
    time_ratio: float  # its time (or time proxy) over the fused step's
    noisy: bool = False  # its time ratio is inside the timing noise
    how: str = ""  # how the step whose peak it is runs: "in one jit", "as two programs"


def _lowest(workload: str, fused: R, rows: Sequence[R], peak: Callable[[R], float | None],
            time: Callable[[R], float | None]) -> Pick | None:
    base_peak, base_time = peak(fused), time(fused)
    if not base_peak or not base_time:
        return None
    fits = [(p, t, getattr(r, "strategy")) for r in rows
            for p, t in [(peak(r), time(r))] if p is not None and t is not None and t <= base_time * TIME_SLACK]
    # The lowest peak as the tables show it (two decimals of the ratio); at a tie the fused
    # step (the default: nothing to change), then the faster.
    p, t, strategy = min(fits, key=lambda x: (round(x[0] / base_peak, 2), x[2] != "fused", x[1]))
    return Pick(workload, strategy, p / base_peak, t / base_time)


def by_workload(rows: Sequence[R]) -> dict[str, list[R]]:
    """The rows of each workload, in the order the workloads first appear."""
    out: dict[str, list[R]] = {}
    for r in rows:
        out.setdefault(getattr(r, "workload"), []).append(r)
    return out


def suite_refs(rows: Sequence[Row]) -> Callable[[Row], Refs[Row]]:
    """A row's references: its workload's fused and jax_fwd_and_bwd rows that did not fail."""
    ok = {(r.workload, r.strategy): r for r in rows if r.ok}
    return lambda r: Refs(ok.get((r.workload, "fused")), ok.get((r.workload, PEER)))


def target_refs(rows: Sequence[TargetRow]) -> Callable[[TargetRow], Refs[TargetRow]]:
    """A target row's reference: its workload's fused step, if it compiled."""
    ok = {r.workload: r for r in rows if r.error is None and r.strategy == "fused"}
    return lambda r: Refs(ok.get(r.workload))


def pick_suite(rows: Sequence[Row]) -> dict[str, Pick | None]:
    """Per workload: the lowest peak as a training loop runs the step (in one jit where
    the strategy has one; jax_fwd_and_bwd as two programs) among the strategies whose
    median step time is within 5% of the fused step's. None: no fused row to compare with."""
    out: dict[str, Pick | None] = {}
    for workload, mine in by_workload(rows).items():
        ok = [r for r in mine if r.ok and r.step is not None]
        fused = next((r for r in ok if r.strategy == "fused"), None)
        pick = None if fused is None else _lowest(
            workload, fused, ok, lambda r: _jitted(r) if _jitted(r) is not None else _peak(r),
            lambda r: r.step.median if r.step else None)
        if pick is not None and fused is not None:
            row = next(r for r in ok if r.strategy == pick.strategy)
            assert row.step is not None and fused.step is not None
            pick = dataclasses.replace(pick, noisy=row is not fused and within_noise(row.step, fused.step),
                                       how="as two programs" if _jitted(row) is None else "in one jit")
        out[workload] = pick
    return out


def pick_target(rows: Sequence[TargetRow]) -> dict[str, Pick | None]:
    """Per workload: the lowest activation peak per device (the peak less the parameters
    and batch, the same for every step) among the steps that move no more than 5% more
    bytes than the fused step (nothing runs on a compile-only target: bytes moved are
    the time proxy)."""
    out: dict[str, Pick | None] = {}
    for workload, mine in by_workload(rows).items():
        ok = [r for r in mine if r.error is None]
        fused = next((r for r in ok if r.strategy == "fused"), None)
        out[workload] = None if fused is None else _lowest(workload, fused, ok, lambda r: r.activation_peak,
                                                           lambda r: r.bytes_moved)
    return out
