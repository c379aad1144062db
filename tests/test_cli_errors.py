"""Bad input: exit code 2 and one line naming the key, path or value, with no traceback."""

from pathlib import Path

import pytest
import torch
from helpers import trainapp

from trainapp.snapshots import store as snapshot


def _corrupt_run(root: Path) -> Path:
    run = root / "corrupt-run"
    snap = snapshot.write_dir(run / "snapshots" / "step_000000005", {"model": {"w": torch.ones(3)}},
                              {"global_step": 5})
    with open(snap / snapshot.STATE, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xff\xff\xff")
    return run


def _garbage_file(root: Path) -> Path:
    p = root / "garbage.pt"
    p.write_bytes(b"this is not a torch file")
    return p


def _bad_yaml(root: Path) -> Path:
    p = root / "bad.yaml"
    p.write_text("train: {epochs: 2\n")
    return p


def _imagefolder_without_val(root: Path) -> Path:
    from PIL import Image

    (root / "imgs" / "train" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(root / "imgs" / "train" / "cat" / "0.png")
    return root / "imgs"


CASES = {
    "unknown key": (lambda r: ["train", "train.batchsize=8"], "train.batchsize"),
    "wrong type": (lambda r: ["train", "train.epochs=two"], "train.epochs='two'"),
    "out of range": (lambda r: ["train", "train.grad_accum=0"], "train.grad_accum=0"),
    "bad enum": (lambda r: ["train", "amp.dtype=fp8"], "amp.dtype='fp8'"),
    "missing config file": (lambda r: ["train", "--config", str(r / "none.yaml")], "none.yaml"),
    "malformed yaml": (lambda r: ["train", "--config", str(_bad_yaml(r))], "bad.yaml"),
    "override syntax": (lambda r: ["train", "train.max_steps"], "train.max_steps"),
    "missing cifar10 dir": (lambda r: ["train", "data.name=cifar10", f"data.root={r}/nocifar",
                                        f"run.dir={r}/run"], "nocifar"),
    "imagefolder without val": (lambda r: ["train", "data.name=imagefolder",
                                           f"data.root={_imagefolder_without_val(r)}", f"run.dir={r}/run"],
                                "imgs/val/"),
    "unknown model": (lambda r: ["train", "model.name=resnet1000", f"run.dir={r}/run"],
                      "model.name='resnet1000'"),
    "lr_mult matches nothing": (lambda r: ["train", "optim.lr_mult={head: 3}", f"run.dir={r}/run"],
                                "optim.lr_mult"),
    "global batch above dataset": (lambda r: ["train", "data.train_size=16", "train.batch_size=64",
                                               f"run.dir={r}/run"], "train.batch_size=64"),
    "fault rank beyond world": (lambda r: ["train", "drill.kill_at_step=3", "drill.rank=4",
                                           f"run.dir={r}/run"],
                                "drill.rank=4"),
    "interface syntax": (lambda r: ["train", "network.interface=eth 0"], "network.interface='eth 0'"),
    "non-NCCL passthrough": (lambda r: ["train", "network.nccl={GLOO_X: 1}"], "network.nccl.GLOO_X"),
    "interface not on this host": (lambda r: ["train", "network.interface=nosuch0", f"run.dir={r}/run"],
                                   "host "),
    "doctor bad config": (lambda r: ["doctor", "train.epochs=two"], "train.epochs='two'"),
    "preempt signal not catchable": (lambda r: ["train", "preempt.signals=[SIGKILL]"], "'SIGKILL'"),
    "preempt signal unknown": (lambda r: ["train", "preempt.signals=[SIGFOO]"], "preempt.signals: 'SIGFOO'"),
    "preempt grace not positive": (lambda r: ["train", "preempt.grace_s=0"], "preempt.grace_s=0"),
    "node without a command": (lambda r: ["node"], "no command to run"),
    "node command missing": (lambda r: ["node", "--", str(r / "no-such-binary")], "no-such-binary"),
    "drain wait not positive": (lambda r: ["drain", "--wait-s", "0"], "--wait-s=0"),
    "only corrupt snapshots": (lambda r: ["train", f"run.dir={_corrupt_run(r)}"], "checksum mismatch"),
    "unreadable snapshot": (lambda r: ["inspect", str(_garbage_file(r))], "garbage.pt"),
    "inspect missing path": (lambda r: ["inspect", str(r / "nowhere")], "nowhere"),
    "inspect corrupt snapshot": (lambda r: ["inspect", str(_corrupt_run(r))], "checksum mismatch"),
}


FRESH = ("unknown key", "only corrupt snapshots")
"""Cases run by a fresh interpreter (the others fork from this process, tests/forked.py): one before
torch is imported, one after."""


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    make_args, needle = CASES[case]
    r = trainapp(*make_args(tmp_path), timeout=120, fresh=case in FRESH)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.output
    assert "Traceback" not in r.output
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], r.stderr
    assert lines[-1] == errors[0]
