"""trainapp: one training loop (DDP or FSDP2, AMP) for a laptop, torchrun, Slurm, Ray and Kubernetes.

Launch commands (the same loop every time; ranks come from the environment):

    # alone (world size 1)
    python -m trainapp train train.max_steps=50 run.dir=runs/solo

    # one node, 2 processes (gloo on CPU, NCCL on GPUs: one process per GPU)
    torchrun --standalone --nproc_per_node=2 -m trainapp train run.dir=runs/ddp

    # two nodes; run on each with NODE_RANK=0/1; run.dir must be storage both nodes see
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD_IP:29500 --max-restarts=3 \\
        -m trainapp train --config configs/imagefolder-resnet50.yaml run.dir=/shared/runs/r50

    # Ray Train on a Ray cluster: `ray job submit` runs the driver, which starts one worker per rank
    ray job submit --address http://HEAD:8265 -- python -m trainapp ray \\
        ray.num_workers=4 ray.storage_path=/shared/runs ray.name=r50

    # inspect the newest valid snapshot of a run; export its model (model.safetensors, loads anywhere)
    python -m trainapp inspect runs/ddp
    python -m trainapp export runs/ddp --out models/ddp

    # your own model: a task (docs/your-own-model.md), by import path or from your own script
    torchrun --standalone --nproc_per_node=2 -m trainapp train \\
        task.name=mypkg.tasks:MyTask task.args.hidden=64
    python -c 'import trainapp, mypkg.tasks; trainapp.main(mypkg.tasks.MyTask())' train.max_steps=50

Re-running a command with the same `run.dir` resumes from its newest valid snapshot.
"""

from typing import Any, Callable

__version__ = "0.1.0"
PUBLIC = ("fit", "fit_ray", "load_model", "main")
"""trainapp/api.py's entry points, importable from here without importing torch with the package."""


def __getattr__(name: str) -> Callable[..., Any]:
    if name in PUBLIC:
        from trainapp import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainapp' has no attribute {name!r}")
