"""Choosing a GPU transport: pure logic over probe findings.

:func:`choose` takes what was asked (``HPCCOMM_GPU_TRANSPORT``, or a
``cuda:<backend>`` entry of torch's backend string) and the probes' findings,
and returns a :class:`Choice` (the transport and the reason, which is logged)
or raises :class:`NoTransport` with a message that names the variable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .probe import Finding

VARIABLE = "HPCCOMM_GPU_TRANSPORT"
#: Transport names: the strategy modules of this package.
MPI, NCCL_TORCH, NCCL_CUPY, STAGED = "mpi", "nccl", "nccl-cupy", "staged"


@dataclass(frozen=True)
class Capabilities:
    """The probes' findings on this rank."""

    mpi_cuda: Finding
    nccl_torch: Finding
    nccl_cupy: Finding


@dataclass(frozen=True)
class Choice:
    transport: str
    reason: str


class NoTransport(Exception):
    """No GPU transport can serve the request; the message says why and what to set."""


def _nccl(caps: Capabilities, why: str) -> Optional[Choice]:
    if caps.nccl_torch.value:
        return Choice(NCCL_TORCH, f"{why}: torch's NCCL ({caps.nccl_torch.how})")
    if caps.nccl_cupy.value:
        return Choice(NCCL_CUPY, f"{why}: CuPy's NCCL ({caps.nccl_cupy.how}); torch has none "
                                 f"({caps.nccl_torch.how})")
    return None


def _found(caps: Capabilities) -> str:
    return (f"CUDA-aware MPI: {caps.mpi_cuda.word()} ({caps.mpi_cuda.how}); NCCL through torch: "
            f"{caps.nccl_torch.word()} ({caps.nccl_torch.how}); NCCL through CuPy: {caps.nccl_cupy.word()} "
            f"({caps.nccl_cupy.how})")


def choose(requested: str, caps: Capabilities, mapped: Optional[str] = None) -> Choice:
    """The transport for CUDA tensors.

    ``requested``: the value of HPCCOMM_GPU_TRANSPORT (auto, mpi, nccl,
    staged).  ``mapped``: the backend torch's backend string names for cuda
    (``"nccl"`` for ``"cpu:hpccomm,cuda:nccl"``), None when there is none or it
    is hpccomm; it wins over the variable.

    Raises :class:`NoTransport`.

    Example::

        >>> caps = Capabilities(Finding(True, "MPIX_Query_cuda_support() returned 1"),
        ...                     Finding(False, "no"), Finding(False, "no"))
        >>> choose("auto", caps).transport
        'mpi'
    """
    if mapped is not None:
        if mapped != "nccl":
            raise NoTransport(f"the backend string maps cuda to '{mapped}', which hpccomm cannot hand CUDA "
                              f"tensors to (torch builds only the first backend when one is a Python process "
                              f"group). Use 'cuda:nccl', or 'hpccomm' alone with {VARIABLE}")
        choice = _nccl(caps, "the backend string maps cuda to nccl")
        if choice is None:
            raise NoTransport(f"the backend string maps cuda to nccl but no NCCL is available ({_found(caps)}). "
                              "Install a torch built with CUDA, or cupy (the 'cuda' extra)")
        return choice
    if requested == STAGED:
        return Choice(STAGED, f"{VARIABLE}=staged: copies through pinned host memory and the CPU path")
    if requested == MPI:
        if caps.mpi_cuda.value is False:
            raise NoTransport(f"{VARIABLE}=mpi but the MPI library is not CUDA-aware ({caps.mpi_cuda.how}). "
                              f"Use a CUDA-aware MPI build, or set {VARIABLE}=nccl or staged")
        if caps.mpi_cuda.value is None:
            return Choice(MPI, f"{VARIABLE}=mpi, trusted: the library could not be asked ({caps.mpi_cuda.how})")
        return Choice(MPI, f"{VARIABLE}=mpi: CUDA-aware MPI ({caps.mpi_cuda.how})")
    if requested == NCCL_TORCH:
        choice = _nccl(caps, f"{VARIABLE}=nccl")
        if choice is None:
            raise NoTransport(f"{VARIABLE}=nccl but no NCCL is available ({_found(caps)}). Install a torch built "
                              f"with CUDA, or cupy (the 'cuda' extra), or set {VARIABLE}=mpi or staged")
        return choice
    if requested != "auto":
        raise NoTransport(f"{VARIABLE}={requested!r} is not one of auto, mpi, nccl, staged")
    if caps.mpi_cuda.value is True:
        return Choice(MPI, f"{VARIABLE}=auto: the MPI library is CUDA-aware ({caps.mpi_cuda.how})")
    choice = _nccl(caps, f"{VARIABLE}=auto, MPI not CUDA-aware ({caps.mpi_cuda.how}), so NCCL")
    if choice is not None:
        return choice
    raise NoTransport(f"no GPU transport: {_found(caps)}. Set {VARIABLE}=staged to copy through host memory "
                      f"(slow), or {VARIABLE}=mpi if you know the MPI library is CUDA-aware, or install NCCL "
                      "(a CUDA build of torch, or cupy)")
