"""CUDA tensors: what ``hpccomm info`` reports about GPUs on this rank.

The transports themselves (CUDA-aware MPI, NCCL through torch or CuPy, staged
through pinned host memory) are :mod:`hpccomm._gpu`'s, chosen once per group
and device; docs/gpu.md says how.
"""
from __future__ import annotations


def info() -> dict:
    """What ``hpccomm info`` reports about GPUs on this rank (MPI must be up).

    Keys: ``mpi_cuda_aware`` (yes/no/unknown) and ``mpi_cuda_aware_how``,
    ``nccl_torch``, ``nccl_cupy`` (yes/no with how), ``gpu_count``,
    ``gpu_transport`` (the variable's value), ``cuda_transport`` (what this
    rank would choose for CUDA tensors and why, or why none),
    ``gpu_binding`` (rank -> GPU).
    """
    from . import config
    from ._gpu import dispatch, probe, select

    caps = dispatch.capabilities()
    requested = config.get("HPCCOMM_GPU_TRANSPORT")
    try:
        choice = select.choose(requested, caps)
        cuda = f"{choice.transport}: {choice.reason}"
    except select.NoTransport as exc:
        cuda = f"none: {exc}"
    count = probe.probe_gpu_count()
    bound = dispatch.binding()
    return {
        "mpi_cuda_aware": caps.mpi_cuda.word(),
        "mpi_cuda_aware_how": caps.mpi_cuda.how,
        "nccl_torch": f"{caps.nccl_torch.word()} ({caps.nccl_torch.how})",
        "nccl_cupy": f"{caps.nccl_cupy.word()} ({caps.nccl_cupy.how})",
        "gpu_count": count.value,
        "gpu_transport": requested,
        "cpu_transport": "mpi (host memory)",
        "cuda_transport": cuda,
        "gpu_binding": (f"GPU {bound['device']}: " if bound["device"] is not None else "none: ") + bound["how"],
    }
