"""aotgrad: ahead-of-time forward/backward compilation for JAX.

    @aotgrad.compile
    def loss_fn(params, batch): ...

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    fwd, bwd = aotgrad.fwd_and_bwd(loss_fn, argnums=0)
    print(aotgrad.explain(loss_fn, params, batch))
"""
from aotgrad.api import AOTFunction as AOTFunction
from aotgrad.api import CacheInfo as CacheInfo
from aotgrad.api import Compiled as Compiled
from aotgrad.api import Lowered as Lowered
from aotgrad.api import compile as compile
from aotgrad.api import fwd_and_bwd as fwd_and_bwd
from aotgrad.config import ConfigError as ConfigError
from aotgrad.config import config as config
from aotgrad.report import Report as Report
from aotgrad.report import SavedValue as SavedValue
from aotgrad.report import explain as explain
from aotgrad.runtime import Saved as Saved
from aotgrad.runtime import Timings as Timings

__version__ = "0.1.0"
