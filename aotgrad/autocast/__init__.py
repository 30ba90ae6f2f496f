"""Per-op mixed precision: which setting is in force (`context`), what each primitive
gets under it (`policy`), and the jaxpr rewrite that applies it (`rewrite`, `transform`)."""
from aotgrad.autocast.context import AutocastState as AutocastState
from aotgrad.autocast.context import Setting as Setting
from aotgrad.autocast.context import current_setting as current_setting
from aotgrad.autocast.policy import TABLES as TABLES
from aotgrad.autocast.policy import register as register
from aotgrad.autocast.policy import table as table
from aotgrad.autocast.rewrite import CastCounts as CastCounts
from aotgrad.autocast.transform import autocast as autocast
