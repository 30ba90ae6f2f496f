"""`plan`: will a training step fit on the devices it will run on, and at which memory budget.

- `build.py`: `plan`, the steps compiled for the target;
- `place.py`: the arguments as `ShapeDtypeStruct`s on the target's mesh (dp, fsdp, specs);
- `steps.py`: the step function (the loss's value and gradient, an optimizer's update);
- `measure.py`: XLA's numbers of one compiled step;
- `table.py`: `Plan` and its `Row`s (`fit`, the table, JSON, the plot).
"""
from aotgrad.planning.build import BUDGETS, plan
from aotgrad.planning.table import DoesNotFit, Plan, Row

__all__ = ["BUDGETS", "DoesNotFit", "Plan", "Row", "plan"]
