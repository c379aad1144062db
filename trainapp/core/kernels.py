"""Which kernels a rank's GPU runs: fast (cuDNN's autotuner, TF32 convolutions) or deterministic
(`train.deterministic`), set once before the model and its first matmul.

A GPU run resumed from a snapshot matches its uninterrupted twin bitwise only with deterministic
kernels: the autotuner may pick another convolution algorithm in the new process, several CUDA
kernels (scatter-adds, some backward passes of convolutions and pooling) add in whatever order the
threads finish, and cuBLAS splits its work by the size of its workspace. On CPU trainapp's runs already
resume bitwise; the switch still turns on `use_deterministic_algorithms`, so an op without a
deterministic kernel fails on a laptop as it would on the cluster.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""What CUDA's docs ask CUBLAS_WORKSPACE_CONFIG to be for deterministic cuBLAS (`:16:8` uses less memory
and is slower)."""


def configure(deterministic: bool, cuda: bool) -> dict[str, object]:
    """Set the kernel choice of this process; what was set, for the start record."""
    if not deterministic:
        if cuda:
            torch.backends.cudnn.benchmark = True  # the autotuner: the fastest convolution per shape
        return {"deterministic": False, "cudnn_benchmark": cuda}
    # cuBLAS reads it when its handle is made, at the first matmul on the device: this is before it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # No TF32: its rounding differs from fp32's. (`conv` is an attribute of the module object torch puts
    # in place of torch.backends.cudnn at import, which its annotations do not show.)
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.use_deterministic_algorithms(True)
    return {"deterministic": True, "cudnn_benchmark": False,
            "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"]}
