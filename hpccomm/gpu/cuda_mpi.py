"""Transport: CUDA-aware MPI.

The op modules run unchanged on device tensors: their MPI buffers are built
from ``data_ptr()`` (``hpccomm._mpi.buffer``), which for a CUDA tensor is a
device pointer that a CUDA-aware MPI library reads and writes directly
(GPUDirect where the hardware has it).  The ops see the group through a
:class:`DeviceView`, which lets their checks accept tensors of that device.

Stream ordering is described in :mod:`hpccomm.gpu.streams`.

float16/bfloat16 reductions are the exception: hpccomm reduces them with a
user-defined MPI op that computes with torch kernels on host memory, which a
CUDA-aware MPI may call with device pointers.  Those calls go through
:mod:`hpccomm.gpu.staged` instead, said once in the log.
"""
from __future__ import annotations

import logging

import torch

from ..ops.p2p import Pending
from .streams import CudaStreams

log = logging.getLogger("hpccomm")

#: Ops that reduce (a 16-bit float among their tensors is staged).
REDUCING = frozenset({"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                      "reduce_scatter_tensor_coalesced"})
_HALF = (torch.float16, torch.bfloat16)


class DeviceView:
    """A group as the op modules see it on the device path: the same group,
    but its checks accept tensors of ``device_type``."""

    def __init__(self, group, device_type: str) -> None:
        self._group = group
        self.device_type = device_type

    def __getattr__(self, name):
        return getattr(self._group, name)


def tensors_in(args):
    """Every tensor among an op's arguments (nested lists included), in order."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from tensors_in(a)


class CudaAwareMPI:
    """Hands device memory to MPI; see the module's docstring."""

    name = "mpi"

    def __init__(self, device, reason: str, staged=None, streams=None) -> None:
        self.device = device
        self.reason = reason
        self.streams = streams if streams is not None else CudaStreams()
        self._staged = staged  # made on first use: the float16/bfloat16 reductions
        self._said_half = False

    def delegate(self, group, op, args, opts):
        return None  # runs through hpccomm's own ops (wrap)

    def _half_path(self):
        if self._staged is None:
            from .staged import Staged

            self._staged = Staged(self.device, "float16/bfloat16 reductions on the CUDA-aware MPI transport",
                                  streams=self.streams)
        if not self._said_half:
            self._said_half = True
            log.warning("hpccomm: float16/bfloat16 reductions of CUDA tensors are staged through host memory: "
                        "hpccomm reduces them with a user-defined MPI op that computes on the host")
        return self._staged

    def wrap(self, op: str, prepare):
        """``prepare`` (an op module's function) for device tensors: checks on
        the caller's thread, an event marking the caller's stream, and a run
        that waits for it and leaves no kernel pending when it returns."""
        def prepared(group, *args):
            if op in REDUCING and any(t.dtype in _HALF for t in tensors_in(args)):
                return self._half_path().wrap(op, prepare)(group, *args)
            run = prepare(DeviceView(group, "cuda"), *args)
            if isinstance(run, Pending):  # p2p, posted now: _mpi.buffer waited for this thread's stream
                return run
            event = self.streams.record(self.device)

            def ordered():
                self.streams.wait(event)  # the caller's kernels producing the inputs are done
                try:
                    return run()
                finally:
                    self.streams.synchronize(self.device)  # the op's own write-back kernels are done

            return ordered

        return prepared
