"""Command line: `trainapp train|ray|inspect|export|config|doctor|report|track|drain|node|slurm-preflight`.

Every command prints one line on stderr for an ending trainapp explains and exits with its code: 2
for bad config or bad input (the line names the key, path or value and what is expected), 3 when
snapshots cannot be written, 128 + N after a handled preemption notice by signal N, 124 for a hung
rank (the table is trainapp/errors.py's); anything else is a runtime failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp import config
from trainapp.errors import Failure, exit_code

if TYPE_CHECKING:
    from trainapp.startup import GcPause


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config; without it the built-in default run")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. train.max_steps=50 run.dir=/tmp/r (CLI > file > defaults)")


def _add_drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait-s", type=float, default=30.0, metavar="S",
                   help="wait at most this long for the training processes to exit (more than "
                        "preempt.grace_s; default 30)")
    p.add_argument("--ray-deadline-s", type=int, default=None, metavar="S",
                   help="first drain this node's Ray node for preemption with this deadline "
                        "(`ray drain-node`), so Ray Train knows it is a preemption and does not restart "
                        "workers here")


def _add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH",
                   help="a run dir (its newest valid snapshot), a snapshots/ dir or a snapshot")
    p.add_argument("--out", required=True, metavar="DIR", help="the export directory (new, or empty)")
    p.add_argument("--step", type=int, metavar="N", help="the snapshot of step N instead of the newest")
    p.add_argument("--ema", action="store_true",
                   help="the EMA copy's weights (a run with train.ema_decay > 0)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="store floating tensors in this dtype (default fp32, as trained)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip loading the file back and comparing its outputs on a validation batch")
    p.add_argument("--force", action="store_true", help="replace --out when it exists and is not empty")


def _add_run_readers(sub: argparse._SubParsersAction) -> None:
    """The commands that read a run's records: `report` and `track`."""
    p = sub.add_parser("report", help="plot a run: a wall-clock timeline of its attempts, then loss, "
                                      "validation, samples/s, lr, loss scale and per-rank timings; print "
                                      "a summary with where the wall time went (goodput)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run.dir of a run (or STORAGE/NAME of a Ray run)")
    p.add_argument("--out", metavar="PNG", help="where the plot goes (default RUN_DIR/report.png)")
    p.add_argument("--compare", metavar="RUN_DIR", nargs="+", default=[],
                   help="other runs whose loss, validation, samples/s and lr are drawn over this run's")
    p = sub.add_parser("track", help="send a run's trackers (observe.mlflow_uri, observe.wandb_project) "
                                     "what they have not taken from metrics.jsonl: each step once")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run.dir of a run (or STORAGE/NAME of a Ray run)")
    p.add_argument("--wait-s", type=float, default=120.0, help="give up after this long (default 120)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainapp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config_args(sub.add_parser("train", help="train (alone, or one rank under torchrun / Ray)"))
    _add_config_args(sub.add_parser("ray", help="drive a Ray Train run of the same loop "
                                                "(what `ray job submit` runs)"))
    p = sub.add_parser("inspect", help="print a snapshot's step, world size and parameter hash as JSON")
    p.add_argument("path", metavar="PATH", help="a snapshot (dir or state.pt), a snapshots/ dir or a run dir")
    _add_export_args(sub.add_parser("export", help="write a run's model as DIR/model.safetensors "
                                                  "(the model's own names) and DIR/trainapp.json, "
                                                  "checked by loading it back"))
    p = sub.add_parser("config", help="print the resolved config as YAML (checks it without training)")
    p.add_argument("--reference", action="store_true",
                   help="instead: the reference of every key, default and meaning "
                        "(docs/configuration.md's table)")
    _add_config_args(p)
    _add_run_readers(sub)
    p = sub.add_parser("drain", help="this node is going away (a pod's preStop, a container's stop): "
                                     "SIGTERM every trainapp training process on it and wait for their "
                                     "snapshots")
    _add_drain_args(p)
    p = sub.add_parser("stop-jobs", help="a Ray head pod's preStop: stop every running Ray job as "
                                         "`ray job stop` does (each trainapp run snapshots the step it "
                                         "reached) and wait for them")
    p.add_argument("--address", default="http://127.0.0.1:8265",
                   help="the Ray dashboard (default: this head's)")
    p.add_argument("--wait-s", type=float, default=60.0,
                   help="seconds to wait for the jobs to end (default 60)")
    p = sub.add_parser("node", help="run a node's command (`ray start --block`, torchrun) as a container's "
                                    "main process; on SIGTERM drain the node first (see drain), then stop "
                                    "the command")
    _add_drain_args(p)
    p.add_argument("node_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the node's command, after --")
    p = sub.add_parser("doctor", help="check this node for a config: versions, GPUs, network interface, "
                                      "/dev/shm, storage, rendezvous (exit 1 if something would fail)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the checks as one JSON list")
    p.add_argument("--comm", action="store_true",
                   help="instead: all-reduce bandwidth between every pair of nodes (run under torchrun, one "
                        "process per node at least); exit 1 if a pair or host is slow")
    p.add_argument("--size-mb", type=float, default=4.0,
                   help="--comm: MiB per all-reduce (default 4)")
    p.add_argument("--iters", type=int, default=5,
                   help="--comm: timed all-reduces per pair (default 5)")
    p.add_argument("--min-bandwidth", type=float, default=0.0,
                   help="--comm: GB/s of bus bandwidth a pair must reach (default 0: only relative "
                        "judgement)")
    p = sub.add_parser("slurm-preflight", help="slurm/train.sbatch's check on every node before torchrun: "
                                               "run.dir is storage every node sees, the interface exists "
                                               "(exit 2, one line)")
    _add_config_args(p)
    p.add_argument("--mark", action="store_true",
                   help="on the batch host: create run.dir and write the marker")
    p.add_argument("--rendezvous", metavar="HOST", help="the rendezvous host: it must resolve, and "
                                                        "network.interface must resolve against it, on "
                                                        "this node")
    return parser


def _val_fields(summary: dict[str, Any]) -> list[str]:
    """The task's evaluation metrics (`val_acc=0.9123`, `val_loss=...`) for a done line."""
    from trainapp.observe.metrics import val_metrics

    return [f"{k}={v:.4f}" for k, v in val_metrics(summary).items() if isinstance(v, (int, float))]


def cmd_train(args: argparse.Namespace, task: Any = None, gc_pause: GcPause | None = None) -> int:
    from trainapp.tasks.load import configure

    cfg, task = configure(args.config, args.overrides, task)
    # torch is imported only once the config is known to be good
    from trainapp.faults.preempt import Preempted
    from trainapp.launch.rank import run_rank
    from trainapp.launch.torchrun import Torchrun

    try:
        summary = run_rank(Torchrun(gc_pause), cfg, task)
    except Preempted as e:  # a notice, handled: snapshot written, the scheduler sees "terminated"
        if e.rank == 0:
            print(e.line(), flush=True)
        else:
            logging.getLogger("trainapp").warning("preempted at step %d; exit %d", e.step, e.exit_code)
        return e.exit_code
    if summary["rank"] == 0:
        print("trainapp: done " + " ".join([
            f"steps={summary['steps']}", f"final_loss={summary['final_loss']:.4f}", *_val_fields(summary),
            f"samples_per_s={summary['samples_per_s']:.1f}",
            f"world_size={summary['world_size']}", f"skipped_steps={summary['skipped_steps']}",
            *([f"goodput={summary['goodput']:.3f}"] if "goodput" in summary else []),
            f"snapshots={summary['snapshots']}",
            *([f"model={summary['model']}"] if summary.get("model") else []),
        ]), flush=True)
    return 0


def cmd_ray(args: argparse.Namespace, task: Any = None) -> int:
    from trainapp.tasks.load import configure

    cfg, task = configure(args.config, args.overrides, task)
    from trainapp.launch.ray import driver
    from trainapp.observe import logs

    logs.setup(0, 1)
    s = driver.run(cfg, task)
    if s.get("stopped_by"):  # a notice, handled: the snapshot of the step reached is registered with Ray
        at = f" at step {s['step']}" if s.get("step") is not None else ""
        print(f"trainapp ray: stopped ({s['stopped_by']}){at}; storage={s['storage']}; "
              "submit again with the same ray.name to resume there", flush=True)
        return s["exit_code"]
    print("trainapp ray: done " + " ".join([
        f"steps={s.get('step')}", f"final_loss={s.get('loss', float('nan')):.4f}", *_val_fields(s),
        f"samples_per_s={s.get('samples_per_s', 0.0):.1f}",
        f"world_size={s.get('world_size')}", f"storage={s['storage']}",
    ]), flush=True)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from trainapp.snapshots import store

    path = Path(args.path)
    if path.is_file() and not (path.parent / store.META).exists():
        state, meta = store.load_state(path.parent, name=path.name), {"path": str(path)}
    else:
        snap = store.resolve(path)
        meta = {"path": str(snap), **store.verify(snap)}
        state = store.load_state(snap)
        # An FSDP run's: the full model from every rank's shard.
        if isinstance(state["model"], str) and state["model"] == store.SHARDED:
            state["model"] = store.full_sharded_model(snap)
    progress, written = state.get("progress", {}), state.get("config", {})
    task = written.get("task", {}).get("name")
    out = {
        **meta,
        **progress,
        "params_sha256": store.tensors_sha256(state["model"]),
        "task": task,
        # `model.name` is the built-in image task's choice; another task's model is its own
        "model": written.get("model", {}).get("name") if task in (None, "image_classification") else None,
    }
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from trainapp.observe import logs
    from trainapp.tools import export

    logs.setup(0, 1)
    out = export.export(args.path, args.out, args.step, args.ema, args.dtype, args.check, args.force)
    print(f"trainapp export: {out}/model.safetensors and {out}/trainapp.json", flush=True)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    if args.reference:
        print(reference_markdown())
        return 0
    print(yaml.safe_dump(config.load(args.config, args.overrides).to_dict(), sort_keys=False), end="")
    return 0


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the field docstrings."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, cls, f in config.leaves():
        info = cls.__pydantic_fields__[f.name]
        doc = " ".join((info.description or "").split()).replace("|", "\\|")
        lines.append(f"| `{key}` | `{info.get_default(call_default_factory=True)!r}` | {doc} |")
    return "\n".join(lines)


def cmd_report(args: argparse.Namespace) -> int:
    from trainapp.tools import report

    png, text = report.run(args.run_dir, args.out, args.compare)
    print(text)
    print(f"report: {png} and {png.with_suffix('.txt')}")
    return 0


def cmd_track(args: argparse.Namespace) -> int:
    from trainapp.tools import track

    lines, whole = track.run(args.run_dir, args.wait_s)
    print("\n".join(lines))
    return 0 if whole else 1


def _check_drain_args(args: argparse.Namespace) -> None:
    if args.wait_s <= 0:
        raise config.ConfigError(f"--wait-s={args.wait_s:g}: must be > 0 (seconds to wait for the snapshots)")


def cmd_drain(args: argparse.Namespace) -> int:
    from trainapp.faults import drain

    _check_drain_args(args)
    stopped, left, said = drain.drain(args.wait_s, args.ray_deadline_s)
    if said:
        print(f"trainapp drain: {said}", flush=True)
    print(f"trainapp drain: {drain.drain_line(stopped, left, args.wait_s)}", flush=True)
    return 1 if left else 0


def cmd_stop_jobs(args: argparse.Namespace) -> int:
    from trainapp.launch.ray.stop import stop_jobs

    if args.wait_s < 0:
        raise config.ConfigError(f"--wait-s={args.wait_s:g}: give the seconds to wait for the jobs, "
                                 "0 or more")
    return stop_jobs(args.address, args.wait_s)


def cmd_node(args: argparse.Namespace) -> int:
    from trainapp.faults import drain

    command = args.node_command[1:] if args.node_command[:1] == ["--"] else args.node_command
    if not command:
        raise config.ConfigError("no command to run; give it after --, e.g. trainapp node -- ray start "
                                 "--address=HEAD:6379 --block")
    _check_drain_args(args)
    return drain.supervise(command, args.wait_s, args.ray_deadline_s)


def cmd_doctor(args: argparse.Namespace) -> int:
    cfg = config.load(args.config, args.overrides)
    if args.comm:
        if "WORLD_SIZE" not in os.environ and (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
            from trainapp.launch.ray import driver  # a Ray job (`ray job submit`): Ray Train starts processes
            from trainapp.observe import logs

            logs.setup(0, 1)
            return driver.run_comm(cfg, args.size_mb, args.iters, args.min_bandwidth)
        from trainapp.launch import comm

        return comm.main(cfg.dist, cfg.network, args.size_mb, args.iters, args.min_bandwidth)
    from trainapp.tools import doctor

    checks = doctor.run(cfg)
    failed = [c.name for c in checks if c.status == doctor.FAIL]
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=2))
    else:
        for c in checks:
            print(c.line())
        print(f"doctor: {len(failed)} problem(s): {', '.join(failed)}" if failed
              else f"doctor: no problems ({len(checks)} checks)")
    return 1 if failed else 0


def cmd_slurm_preflight(args: argparse.Namespace) -> int:
    from trainapp.launch import slurm

    cfg = config.load(args.config, args.overrides)
    return slurm.main(cfg.run.dir, cfg.network, args.rendezvous, args.mark)


def main(argv: list[str] | None = None, task: Any = None, gc_pause: GcPause | None = None) -> int:
    """The command line; `task`: a task object for `train` and `ray` (trainapp/api.py), instead of the
    one `task.name` names; `gc_pause`: the collector paused by the entry point (trainapp/startup.py), for
    `train` to end once its parts are built."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, task, gc_pause)
        if args.command == "ray":
            return cmd_ray(args, task)
        return {"inspect": cmd_inspect, "export": cmd_export, "config": cmd_config, "doctor": cmd_doctor,
                "report": cmd_report, "track": cmd_track,
                "drain": cmd_drain, "node": cmd_node, "slurm-preflight": cmd_slurm_preflight,
                "stop-jobs": cmd_stop_jobs}[args.command](args)
    except Failure as e:  # an ending trainapp explains: one line, its own exit code (trainapp.errors)
        print(f"trainapp {args.command}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt as e:
        return exit_code(e)
    except BrokenPipeError:  # output piped into `head` and the like
        return 0


if __name__ == "__main__":
    sys.exit(main())
