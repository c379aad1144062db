"""CPU autocast: a training step in bf16 autocast against the same step in fp32.

On a CPU, whether bf16 pays depends on the hardware (AVX-512 BF16 / AMX make it fast; without them
oneDNN emulates it) and on the model. This measures it here, so `amp.dtype=auto` (bf16 on CPU) can be
judged: one process, the machine's cores as intra-op threads, fp32 and bf16 rounds alternating, the
median step time of each. A ratio below 1 means bf16 is faster.

    python -m bench.amp_cpu            # writes bench/results/amp_cpu.json
    python -m bench.amp_cpu --smoke    # seconds; for CI, writes bench/results/smoke/
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from bench.common import result_path
from bench.machine import describe, simd_flags


def measure(model_name: str, batch: int, image_size: int, rounds: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from trainapp.tasks.image import build_model

    torch.manual_seed(0)
    model = build_model(model_name, 10).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    contexts = {"fp32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    times = {"fp32": [], "bf16": []}
    for r in range(rounds + 1):
        for mode in (("fp32", "bf16") if r % 2 else ("bf16", "fp32")):
            t0 = time.perf_counter()
            for _ in range(steps):
                with contexts[mode]():
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if r > 0:  # round 0 warms up both
                times[mode].append((time.perf_counter() - t0) / steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "image_size": image_size, "fp32_step_ms": 1000 * med["fp32"],
            "bf16_step_ms": 1000 * med["bf16"], "bf16_vs_fp32_step_ratio": med["bf16"] / med["fp32"],
            "rounds_ms": {k: [round(1000 * t, 2) for t in v] for k, v in times.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run that only checks the benchmark works")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--models", default="smallcnn:64,resnet18:16", help="name:batch pairs")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", help="result file (default bench/results/amp_cpu.json)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.models = 1, 2, "smallcnn:8"
    out = result_path("amp_cpu.json", args.smoke, args.out)
    import torch

    torch.set_num_threads(args.threads)
    models = {}
    for item in args.models.split(","):
        name, _, batch = item.partition(":")
        models[name] = measure(name, int(batch or 16), args.image_size, args.rounds, args.steps)
        m = models[name]
        print(f"{name}: fp32 {m['fp32_step_ms']:.1f} ms/step, bf16 {m['bf16_step_ms']:.1f} ms/step, "
              f"ratio {m['bf16_vs_fp32_step_ratio']:.3f}", flush=True)
    result = {"bf16_vs_fp32_step_ratio": {k: v["bf16_vs_fp32_step_ratio"] for k, v in models.items()},
              "models": models, "cpu_flags": simd_flags(), "torch": torch.__version__,
              "threads": args.threads, "machine": describe(),
              "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"bf16_vs_fp32_step_ratio={result['bf16_vs_fp32_step_ratio']} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
