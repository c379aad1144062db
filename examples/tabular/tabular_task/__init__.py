"""A user's own task for trainapp: regression on tabular data (see task.py)."""

from tabular_task.task import Regression

__all__ = ["Regression"]
