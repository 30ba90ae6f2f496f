"""The errors aotgrad raises about its options (the lowest layer: anything may raise them)."""
from __future__ import annotations

__all__ = ["BudgetUnreachable", "ConfigError"]


class ConfigError(ValueError):
    """An unknown option or a value an option does not accept."""


class BudgetUnreachable(ConfigError):
    """A byte `activation_memory_budget` below the lowest step peak aotgrad can plan."""

    def __init__(self, budget: int, smallest: int) -> None:
        self.budget, self.smallest = budget, smallest
        super().__init__(
            f"aotgrad.config.activation_memory_budget={budget:,} bytes cannot be met: the smallest "
            f"step peak aotgrad can plan for this function is about {smallest:,} bytes per device (estimated, "
            f"{smallest / 2 ** 20:.1f} MiB). Raise the budget to at least that, or give a fraction in [0, 1].")
