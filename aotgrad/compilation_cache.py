"""Whether JAX's persistent compilation cache is on: `aotgrad.config.compilation_cache_dir`.

JAX keeps one cache directory per process, so the option is process-wide: the value in
force when aotgrad next builds, exports or loads programs is applied to JAX. Programs
are cached whatever their size or compile time (JAX's defaults skip programs that
compile in under a second, which are most programs on CPU), so a second process finds
every program of the first one.
"""
from __future__ import annotations

import threading

import jax

from aotgrad._jax_internals import reset_compilation_cache
from aotgrad.config import config

__all__ = ["ensure_compilation_cache"]

_lock = threading.Lock()
_applied: list[str | None] = [None]  # the directory last handed to JAX by aotgrad


def ensure_compilation_cache() -> None:
    """Hands `aotgrad.config.compilation_cache_dir` to JAX if it changed (cheap otherwise)."""
    path = config.compilation_cache_dir
    if path == _applied[0]:
        return
    with _lock:
        if path == _applied[0]:
            return
        if path is None:  # turned off: leave JAX as the user set it outside aotgrad
            jax.config.update("jax_compilation_cache_dir", None)
        else:
            jax.config.update("jax_compilation_cache_dir", path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        reset_compilation_cache()  # JAX opens its cache once; make it open the new directory
        _applied[0] = path
