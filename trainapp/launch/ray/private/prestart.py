"""Idle worker processes started ahead of need (trainapp/launch/ray/spares.py): Ray's Raylet starts
idle workers for a job and runtime env when asked (its `PrestartWorkers` call) and hands them to the
next tasks or actors of that job and env.

Private names: the Raylet's gRPC service and its messages (`ray.core.generated`) and Ray's gRPC channel
with the cluster's token (`ray._private.grpc_utils.init_grpc_channel`).
"""

from __future__ import annotations

from trainapp.launch.ray.private import unsupported

PRIVATE_NAMES = (
    ("ray._private.grpc_utils", "init_grpc_channel"),
)

TIMEOUT_S = 10.0


def prestart(n: int, keep_s: int) -> None:
    """Ask this node's Raylet for `n` idle worker processes of this process's job, with its runtime
    env, kept at least `keep_s` seconds (Ray's idle reaper leaves them alone for that long)."""
    import ray

    try:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import (common_pb2, node_manager_pb2, node_manager_pb2_grpc,
                                        runtime_environment_pb2)
    except ImportError as e:
        raise unsupported(e, __name__) from None

    ctx = ray.get_runtime_context()
    node = next(n for n in ray.nodes() if n["NodeID"] == ctx.get_node_id())
    # protoc's modules have no type stubs: mypy cannot see their message classes.
    env = runtime_environment_pb2.RuntimeEnvInfo(  # type: ignore[attr-defined]
        serialized_runtime_env=ctx.get_runtime_env_string())
    request = node_manager_pb2.PrestartWorkersRequest(  # type: ignore[attr-defined]
        language=common_pb2.Language.PYTHON,  # type: ignore[attr-defined]
        job_id=bytes.fromhex(ctx.get_job_id()), runtime_env_info=env, keep_alive_duration_secs=keep_s,
        num_workers=n)
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=TIMEOUT_S)
    finally:
        channel.close()
