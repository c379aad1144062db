"""What a resume changes: the keys of this run's config that differ from the config its snapshot was
written with, and the ones a resume may not change without the user saying so (`run.allow_changes`).

A snapshot's state means something only under the config that made it: resumed under another seed,
its data order is not the one it trained on; under another model or dataset, its weights are someone
else's. Those keys are `FIXED`. Every other difference (more steps, the learning rate, the cadence of
evaluation and snapshots, the launcher's keys) is what users change on purpose: it is listed, and the
run goes on.
"""

from __future__ import annotations

from typing import Any

from trainapp.errors import ConfigError

FIXED = ("seed", "task.name", "task.args", "model.name", "model.num_classes", "data.name", "data.root",
         "data.train_size", "data.val_size", "data.synthetic_classes", "data.image_size")
"""Keys (and sections) a resume may not change unless `run.allow_changes` names them."""
ABSENT = "(absent)"


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (a mapping value, such as `task.args`, is walked too)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """key -> [value in `old`, value in `new`] for every leaf that differs (ABSENT where one lacks it)."""
    a, b = flat(old), flat(new)
    return {k: [a.get(k, ABSENT), b.get(k, ABSENT)] for k in sorted(a.keys() | b.keys())
            if a.get(k, ABSENT) != b.get(k, ABSENT)}


def _under(key: str, names: list[str] | tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def line(diff: dict[str, list[Any]]) -> str:
    """'optim.lr 0.05 -> 0.5, train.max_steps 20 -> 40'."""
    def show(v: Any) -> str:
        return v if v is ABSENT else repr(v)

    return ", ".join(f"{k} {show(a)} -> {show(b)}" for k, (a, b) in diff.items())


def check_resume(old: dict[str, Any] | None, new: dict[str, Any], allow: list[str],
                 where: str) -> dict[str, list]:
    """The changes from the snapshot's config `old` (at `where`) to this run's `new`; ConfigError naming
    the first key a resume may not change unless `allow` names it. A snapshot with no config (written
    by hand, or by an old trainapp) has nothing to compare."""
    if not old:
        return {}
    diff = changes(old, new)
    refused = {k: v for k, v in diff.items() if _under(k, FIXED) and not _under(k, allow) and ABSENT not in v}
    if refused:
        key, (was, now) = next(iter(refused.items()))
        more = f" (and {', '.join(list(refused)[1:])})" if len(refused) > 1 else ""
        raise ConfigError(f"{key}={now!r}: the snapshot {where} was trained with {key}={was!r}{more}; "
                          f"resumed under another {key} its state means nothing. Keep {key}={was!r}, use a "
                          f"new run.dir (ray.name under Ray) to start afresh, or add "
                          f"run.allow_changes=[{key}] if you mean it")
    return diff
