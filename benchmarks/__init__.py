"""Benchmarks for aotgrad: step time, saved memory and build cost of aotgrad's
forward/backward programs against `jax.fwd_and_bwd` and a fused `jax.jit(value_and_grad)`.

    python -m benchmarks.run                  # the default suite (config/cpu.toml)
    python -m benchmarks.overhead             # per-call overhead on tiny inputs

See docs/benchmarks.md.
"""
