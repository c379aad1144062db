"""Run configuration: dataclass sections, a YAML file, and `section.key=value` overrides.

Precedence: command-line overrides > the `--config` YAML file > the defaults below (with no
`--config`, the built-in run that `make run` uses). Validation is pydantic's (unknown keys, wrong
types, ranges); cross-field checks live in each section's `__post_init__`. Every problem becomes a
`ConfigError` whose message is one line naming the key, the value and what is expected, e.g.
`train.grad_accum=0: must be >= 1`. This module imports neither torch nor ray, so a bad command
line fails in a fraction of a second.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from trainapp.config.base import STRICT, public
from trainapp.config.faults import DrillSection, FaultSection, PreemptSection
from trainapp.config.launch import DistSection, NetworkSection, ParallelSection, RaySection
from trainapp.config.run import (
    TASK_DEFAULTS,
    AmpSection,
    DataSection,
    InitSection,
    ModelSection,
    ObserveSection,
    OptimSection,
    RunSection,
    SchedSection,
    SnapshotSection,
    TaskSection,
    TrainSection,
)
from trainapp.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


@dataclass(config=STRICT)
class Config:
    seed: int = 0
    """Seed of the model init, the data order, the synthetic dataset and the task's own randomness
    (its `ctx.seed`)."""
    run: RunSection = dataclasses.field(default_factory=RunSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    init: InitSection = dataclasses.field(default_factory=InitSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    sched: SchedSection = dataclasses.field(default_factory=SchedSection)
    amp: AmpSection = dataclasses.field(default_factory=AmpSection)
    snapshot: SnapshotSection = dataclasses.field(default_factory=SnapshotSection)
    fault: FaultSection = dataclasses.field(default_factory=FaultSection)
    drill: DrillSection = dataclasses.field(default_factory=DrillSection)
    observe: ObserveSection = dataclasses.field(default_factory=ObserveSection)
    preempt: PreemptSection = dataclasses.field(default_factory=PreemptSection)
    dist: DistSection = dataclasses.field(default_factory=DistSection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)
    network: NetworkSection = dataclasses.field(default_factory=NetworkSection)
    ray: RaySection = dataclasses.field(default_factory=RaySection)

    def __post_init__(self) -> None:
        if self.data.name != "synthetic" and not self.data.root:
            raise ConfigError(f"data.root='': data.name={self.data.name} needs a dataset directory")
        if (self.data.name == "synthetic"
                and self.model.num_classes not in (None, self.data.synthetic_classes)):
            raise ConfigError(
                f"model.num_classes={self.model.num_classes}: the synthetic dataset has "
                f"data.synthetic_classes={self.data.synthetic_classes}; set them equal or "
                "leave num_classes empty"
            )

    def to_dict(self) -> dict[str, Any]:
        # Field names as users write them; the values of dict fields (ray.env, ...) are left alone.
        return {name: {public(k): v for k, v in value.items()} if isinstance(value, dict) else value
                for name, value in dataclasses.asdict(self).items()}


_ADAPTER = TypeAdapter(Config)
MOVED = MappingProxyType({f"fault.{f.name}": f"drill.{f.name}" for f in dataclasses.fields(DrillSection)})
"""Keys that moved to another section, for the error that names an old one."""


def _key_of(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _section_of(f: dataclasses.Field[Any]) -> type[Any] | None:
    """The section class a field holds, or None for a plain value."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def leaves(cls: type[Any] = Config,
           prefix: str = "") -> Iterator[tuple[str, type[Any], dataclasses.Field[Any]]]:
    """(dotted key as users write it, the section class, the field) of every leaf key (`train.max_steps`)."""
    for f in dataclasses.fields(cls):
        section = _section_of(f)
        if section:
            yield from leaves(section, f"{prefix}{f.name}.")
        else:
            yield prefix + public(f.name), cls, f


def _format_error(err: ErrorDetails) -> str:
    key, kind, value = _key_of(err["loc"]), err["type"], err.get("input")
    known = [k for k, _, _ in leaves()]
    # A union field reports one error per member type (`ray.num_workers.int`): name the field itself.
    while key not in known and "." in key and key.rsplit(".", 1)[0] in known:
        key = key.rsplit(".", 1)[0]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        if key in MOVED:
            return f"unknown key {key}: it moved to {MOVED[key]}"
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else "; see docs/configuration.md"
        return f"unknown key {key}{hint}"
    msg = err["msg"]
    if kind == "value_error":
        # Our own cross-field checks already name the key and value.
        return msg.removeprefix("Value error, ")
    if kind == "dataclass_type":
        return f"{key}={value!r}: must be a mapping of {key}.* keys"
    return f"{key}={value!r}: {msg[0].lower() + msg[1:]}"


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a nested mapping into a Config; raise ConfigError naming the first bad key."""
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as e:
        messages: dict[str, str] = {}
        for err in e.errors():
            msg = _format_error(err)
            head, _, tail = msg.partition(": ")
            messages[head] = (f"{messages[head]} or {tail}" if head in messages and tail
                              else messages.get(head, msg))
        raise ConfigError("; ".join(messages.values())) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.max_steps=50` -> (['train', 'max_steps'], 50). Values are parsed as YAML scalars/flows."""
    key, sep, text = item.partition("=")
    if not sep or not key or any(not p.isidentifier() for p in key.split(".")):
        raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. train.max_steps=50")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML: keep the raw string and let the field's type decide
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {p}: no such file; pass an existing YAML file (see configs/)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or "malformed YAML"
        raise ConfigError(f"--config {p}: not valid YAML{at} ({problem})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {p}: cannot read it ({e.__class__.__name__}: {e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {p}: top level must be a mapping of sections (run:, train:, ...)")
    return data


def load(path: str | Path | Mapping | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then a built-in task's defaults (TASK_DEFAULTS), then the YAML file (or a mapping of the
    same shape, from Python), then the overrides (CLI > file > task > defaults)."""
    tree = copy.deepcopy(dict(path)) if isinstance(path, Mapping) else read_yaml(path) if path else {}
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value, item)
    task = tree.get("task")
    name = task.get("name") if isinstance(task, dict) else None
    for dotted, value in TASK_DEFAULTS.get(name, {}).items() if isinstance(name, str) else ():
        *sections, leaf = dotted.split(".")
        node = tree
        for part in sections:
            node = node.setdefault(part, {})
        if isinstance(node, dict):
            node.setdefault(leaf, value)
    return from_dict(tree)
