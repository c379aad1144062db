"""torch's private names, fenced (trainapp/core/torch_private.py): each one exists on the installed torch,
and no other module of trainapp reads a private name of torch."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from trainapp.core import torch_private

PACKAGE = Path(__file__).resolve().parents[1] / "trainapp"
FENCE = PACKAGE / "core" / "torch_private.py"
TORCH_ROOTS = {"torch", "nn", "F", "dist", "tdist", "dcp"}
"""Names trainapp's modules import torch (or a part of it) as."""
PRIVATE_ATTRIBUTES = {"_get_fsdp_state", "_fsdp_param_groups", "_scale", "_BatchNorm",
                      "_is_mkldnn_bf16_supported", "graph_break_reasons", "get_cpp_compiler",
                      "counters", "cache_dir", "_workers", "_worker_pids_set", "_remove_worker_pids"}
"""torch's private names that are attributes of an object, not of torch: found wherever they are read."""


def test_every_private_name_of_torch_trainapp_reads_exists_here():
    assert issubclass(torch.nn.SyncBatchNorm, torch_private.BatchNormBase)
    assert issubclass(torch.nn.BatchNorm2d, torch_private.BatchNormBase)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # makes the scale tensor
    assert float(torch_private.scale_tensor(scaler)) == 1024.0
    assert (isinstance(torch_private.onednn_bf16(), bool)
            and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported"))
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(FSDPModule._get_fsdp_state)
    assert "self._fsdp_param_groups" in inspect.getsource(FSDPState)
    assert isinstance(torch_private.graph_breaks(), list)
    before = torch_private.compiled_graphs()
    torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    assert torch_private.compiled_graphs() == before + 1
    assert any(Path(torch_private.inductor_cache_dir()).iterdir())  # that compile's code is there
    from torch._dynamo.utils import graph_break_reasons
    from torch._inductor.cpp_builder import get_cpp_compiler

    assert isinstance(graph_break_reasons, list) and callable(get_cpp_compiler)
    compiler, tried = torch_private.cpp_compiler()
    assert tried and (compiler is None or compiler in tried), (compiler, tried)
    loader = torch.utils.data.DataLoader(range(4), num_workers=1)
    it = iter(loader)
    (worker,) = torch_private.loader_workers(it)
    assert worker.is_alive() and it._worker_pids_set
    torch_private.unwatch_loader_workers(it)
    assert not it._worker_pids_set
    worker.kill()  # off torch's SIGCHLD check: nothing raises here
    worker.join(5)
    del it
    assert len(torch_private.PRIVATE) == len(PRIVATE_ATTRIBUTES)


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_module_but_the_fence_reads_a_private_name_of_torch():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == FENCE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            private = (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                       and not node.attr.startswith("__"))
            if private and (node.attr in PRIVATE_ATTRIBUTES or _root(node) in TORCH_ROOTS):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [a.name for a in node.names if a.name.startswith("_")]
                parts = [p for p in (node.module or "").split(".") if p.startswith("_")]
                if names or parts:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from {node.module} import ...")
    assert not found, found
