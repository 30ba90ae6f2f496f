"""The public entry points: `compile` (the decorator object, `function`; its entries,
`cache`), the ahead-of-time stages (`stages`) and `fwd_and_bwd`."""
from aotgrad.api.cache import CacheInfo as CacheInfo
from aotgrad.api.function import AOTFunction as AOTFunction
from aotgrad.api.function import compile as compile
from aotgrad.api.fwd_bwd import fwd_and_bwd as fwd_and_bwd
from aotgrad.api.stages import Compiled as Compiled
from aotgrad.api.stages import Lowered as Lowered
from aotgrad.api.stages import Traced as Traced

__all__ = ["AOTFunction", "CacheInfo", "Compiled", "Lowered", "Traced", "compile", "fwd_and_bwd"]
