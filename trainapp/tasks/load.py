"""`task.name` and `task.args` to a task object, every way that can go wrong one line naming it.

Built-in names resolve to factories in this package that also read the config (the image task's
`data.*` and `model.*` keys); any other name is an import path `package.module:attr` whose `attr`
is called with `task.args` as keyword arguments. Nothing here runs the task: `check` only looks at
what it is (the methods it has), so the Ray driver can do it before any worker starts.
"""

from __future__ import annotations

import importlib
import inspect
from types import MappingProxyType
from typing import Any, Callable

from trainapp.config import IMPORT_PATH, Config, ConfigError
from trainapp.config import load as config_load
from trainapp.errors import first_line
from trainapp.tasks.api import OPTIONAL, REQUIRED

BUILTIN = MappingProxyType({
    "image_classification": ("trainapp.tasks.image:from_config", True),
    "char_lm": ("trainapp.tasks.char_lm:CharLM", False),
})
"""Built-in task name -> (its factory, whether the factory takes the config first:
factory(cfg, **task.args))."""
DOCS = "docs/your-own-model.md"


def find(path: str) -> Callable:
    """The callable `package.module:attr` names; ConfigError naming `task.name` when it cannot be had."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time error of the user's module: its own message says what
        raise ConfigError(f"task.name={path!r}: cannot import {module_name} ({first_line(e)}); put its "
                          f"package on PYTHONPATH, pip install it, or under Ray ship it with --working-dir "
                          f"({DOCS})") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            where = getattr(module, "__file__", None) or module_name
            raise ConfigError(f"task.name={path!r}: {module_name} ({where}) has no attribute {attr}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"task.name={path!r}: {attr} is a {type(target).__name__}, not callable; name a "
                          "class or a function that returns the task")
    return target


def make(factory: Callable, name: str, args: dict[str, Any], *leading: Config) -> Any:
    """`factory(*leading, **args)`; arguments it does not take, or a TypeError/ValueError it raises about
    them, become one line naming `task.args`."""
    try:
        inspect.signature(factory).bind(*leading, **args)
    except TypeError as e:
        raise ConfigError(f"task.args={args}: {name} cannot be called with them ({e}); its parameters are "
                          f"{_parameters(factory, len(leading))}") from None
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    try:
        return factory(*leading, **args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task.args={args}: {name} rejected them ({first_line(e)})") from None


def _parameters(factory: Callable, skip: int) -> str:
    try:
        try:  # the annotations as written, also in a module with `from __future__ import annotations`
            params = list(inspect.signature(factory, eval_str=True).parameters.values())[skip:]
        except Exception:  # an annotation that does not evaluate: the strings
            params = list(inspect.signature(factory).parameters.values())[skip:]
    except ValueError:
        return "unknown"
    return "(" + ", ".join(str(p) for p in params) + ")" if params else "none: it takes no task.args"


def check(task: Any, name: str) -> Any:
    """`task`, when it has every method the contract requires; else one line naming what is missing."""
    missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(f"task.name={name!r}: the task ({type(task).__name__}) has no {', '.join(missing)} "
                          f"method; a task has datasets(ctx), model(ctx), loss(model, batch) and "
                          f"evaluate(model, batch) ({DOCS})")
    odd = [m for m in OPTIONAL if getattr(task, m, None) is not None and not callable(getattr(task, m))]
    if odd:
        raise ConfigError(f"task.name={name!r}: the task's {odd[0]} is a "
                          f"{type(getattr(task, odd[0])).__name__}, not a method; the optional methods are "
                          f"{', '.join(OPTIONAL)} ({DOCS})")
    halves = [callable(getattr(task, m, None)) for m in ("state_dict", "load_state_dict")]
    if any(halves) and not all(halves):
        raise ConfigError(f"task.name={name!r}: the task has only one of state_dict and load_state_dict; "
                          "give it both or neither")
    return task


def configure(config: Any, overrides: list[str], task: Any = None) -> tuple[Config, Any]:
    """The run's config (`config`: a YAML path, a mapping or None; then `overrides`) and `task`, a task
    object handed over from Python (trainapp/api.py) or None for the one `task.name` names. A task
    object is recorded in the config as where its class lives (`task.name=module:Class`, where it can
    be written as one) with no `task.args` (the object is made), and checked."""
    if task is None:
        return config_load(config, overrides), None
    cls = type(task)
    path = f"{cls.__module__}:{cls.__qualname__}"
    cfg = config_load(config, [*([f"task.name={path}"] if IMPORT_PATH.fullmatch(path) else []),
                               "task.args={}", *overrides])
    if cfg.task.args:
        raise ConfigError(f"task.args={cfg.task.args}: the task comes made by the script "
                          f"({type(task).__name__}); pass its arguments there, or name it with task.name "
                          "instead of handing it over")
    return cfg, check(task, cfg.task.name)


def resolve(cfg: Config) -> Any:
    """The task `cfg.task` names, made and checked."""
    name, args = cfg.task.name, dict(cfg.task.args)
    if name in BUILTIN:
        path, takes_config = BUILTIN[name]
        return check(make(find(path), name, args, *([cfg] if takes_config else [])), name)
    return check(make(find(name), name, args), name)
