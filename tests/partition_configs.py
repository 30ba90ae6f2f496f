"""The configurations tests run under: every registered partitioner (new ones are picked up
when they register in `aotgrad.partitioners()`) and, for those other than
"vjp", the activation memory budgets worth testing."""
from __future__ import annotations

from typing import Any, Sequence

import aotgrad

BUDGETS = (0.0, 0.5, 1.0)


def partitioner_configs(budgets: Sequence[float] = BUDGETS) -> list[dict[str, Any]]:
    """`aotgrad.config.patch` keyword arguments, one dict per configuration."""
    configs: list[dict[str, Any]] = []
    for name in aotgrad.partitioners():
        if name == "vjp":  # one saved set: the budget does not apply
            configs.append({"partitioner": name})
        else:
            configs.extend({"partitioner": name, "activation_memory_budget": b} for b in budgets)
    return configs


def config_id(config: dict[str, Any]) -> str:
    budget = config.get("activation_memory_budget")
    return config["partitioner"] + ("" if budget is None else f"@{budget:g}")
