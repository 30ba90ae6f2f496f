"""The public entry points: `compile` (the decorator object, `function`), the ahead-of-time
stages (`stages`) and `fwd_and_bwd`."""
from aotgrad.api.function import AOTFunction as AOTFunction
from aotgrad.api.function import CacheInfo as CacheInfo
from aotgrad.api.function import compile as compile
from aotgrad.api.fwd_bwd import fwd_and_bwd as fwd_and_bwd
from aotgrad.api.stages import Compiled as Compiled
from aotgrad.api.stages import Lowered as Lowered

__all__ = ["AOTFunction", "CacheInfo", "Compiled", "Lowered", "compile", "fwd_and_bwd"]
