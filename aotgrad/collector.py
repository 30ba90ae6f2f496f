"""Python's cycle collector held off while a program pair is planned.

Tracing and planning allocate hundreds of thousands of containers (tracers, equations,
the candidates' index lists) that live until the plan is made. Each full collection they
set off scans every tracked object again, the user's and the growing joint graph's: on a
24-layer GPT the collector took about a fifth of a plan's time. Planning keeps what it
makes until it returns, so nothing waits on the collector meanwhile; it is switched back
on after, if it was on, and the cycles made meanwhile are collected then as usual.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["collector_paused"]

_pause = threading.Lock()
_paused = [0, False]  # how many callers hold the collector off; whether it was on before


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside (nested and threaded uses count), restored after."""
    with _pause:
        if not _paused[0]:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1
    try:
        yield
    finally:
        with _pause:
            _paused[0] -= 1
            if not _paused[0] and _paused[1]:
                gc.enable()
