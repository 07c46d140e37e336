"""CUDA tensors: the GPU transports, chosen per group and device.

One module per strategy: :mod:`~hpccomm.gpu.cuda_mpi` (device memory handed
to a CUDA-aware MPI), :mod:`~hpccomm.gpu.nccl_torch` (torch's NCCL process
group on hpccomm's store), :mod:`~hpccomm.gpu.nccl_cupy` (CuPy's NCCL, unique
id over MPI), :mod:`~hpccomm.gpu.staged` (reused pinned host buffers and the
CPU path).  :mod:`~hpccomm.gpu.probe` asks the libraries what they can do,
:mod:`~hpccomm.gpu.select` decides, :mod:`~hpccomm.gpu.dispatch` routes the
adapter's ops.  Nothing here runs at import: probes run at the first CUDA op
or for ``hpccomm info``.  See docs/gpu.md.
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
    from .. import config
    from . import dispatch, probe, select

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
