"""Tasks: the user's part of a run (datasets, model, loss, evaluation) behind one public contract
(trainapp/tasks/api.py, docs/your-own-model.md), the two built-in ones (image classification, a
character-level language model) and how `task.name` finds one (trainapp/tasks/load.py)."""

from trainapp.tasks.api import Task, TaskContext

__all__ = ["Task", "TaskContext"]
