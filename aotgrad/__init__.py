"""aotgrad: ahead-of-time forward/backward compilation for JAX.

    @aotgrad.compile
    def loss_fn(params, batch): ...

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    fwd, bwd = aotgrad.fwd_and_bwd(loss_fn, argnums=0)
    loss_fn.register_hook(lambda g, path: jnp.clip(g, -1, 1), per_leaf=True)   # traced into the backward
    print(aotgrad.explain(loss_fn, params, batch))

    with aotgrad.autocast("gpu", dtype=jnp.bfloat16):   # per-op mixed precision
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
"""
from aotgrad import _jax_internals  # noqa: F401 (first: refuses a JAX older than the supported one)
from aotgrad.api import AOTFunction as AOTFunction
from aotgrad.api import CacheInfo as CacheInfo
from aotgrad.api import Compiled as Compiled
from aotgrad.api import Lowered as Lowered
from aotgrad.api import Traced as Traced
from aotgrad.api import compile as compile
from aotgrad.api import fwd_and_bwd as fwd_and_bwd
from aotgrad.autocast import CastCounts as CastCounts
from aotgrad.autocast import autocast as autocast
from aotgrad.autocast import register as register_autocast_policy
from aotgrad.autocast import table as autocast_policy_table
from aotgrad.config import config as config
from aotgrad.errors import BudgetUnreachable as BudgetUnreachable
from aotgrad.errors import ConfigError as ConfigError
from aotgrad.export import Exported as Exported
from aotgrad.export import ExportError as ExportError
from aotgrad.export import deserialize as deserialize
from aotgrad.export import export as export
from aotgrad.hooks import HookHandle as HookHandle
from aotgrad.hooks import grad_hook as grad_hook
from aotgrad.loss_scale import DynamicLossScale as DynamicLossScale
from aotgrad.loss_scale import all_finite as all_finite
from aotgrad.loss_scale import select_tree as select_tree
from aotgrad.partition import partitioners as partitioners
from aotgrad.partition import register_partitioner as register_partitioner
from aotgrad.planning import DoesNotFit as DoesNotFit
from aotgrad.planning import Plan as Plan
from aotgrad.planning import plan as plan
from aotgrad.report import Memory as Memory
from aotgrad.report import Report as Report
from aotgrad.report import SavedValue as SavedValue
from aotgrad.report import explain as explain
from aotgrad.runtime import Saved as Saved
from aotgrad.runtime import Timings as Timings

__all__ = ["AOTFunction", "BudgetUnreachable", "CacheInfo", "CastCounts", "Compiled", "ConfigError",
           "DoesNotFit", "DynamicLossScale", "ExportError", "Exported", "HookHandle", "Lowered", "Memory", "Plan",
           "Report", "Saved", "SavedValue", "Timings", "Traced", "all_finite", "autocast", "autocast_policy_table",
           "compile", "config", "deserialize", "explain", "export", "fwd_and_bwd", "grad_hook", "partitioners",
           "plan", "register_autocast_policy", "register_partitioner", "select_tree"]

__version__ = "0.1.0"
