"""Transport: CUDA-aware MPI.

The op modules run unchanged on device tensors: their MPI buffers are built
from ``data_ptr()`` (``hpccomm._mpi.buffer``), which for a CUDA tensor is a
device pointer that a CUDA-aware MPI library reads and writes directly
(GPUDirect where the hardware has it).  The ops see the group through a
:class:`DeviceView`, which lets their checks accept tensors of that device.

Stream ordering is described in :mod:`hpccomm._gpu.streams`.

float16/bfloat16 reductions are the exception: on the CPU path hpccomm
reduces them with a user-defined MPI op that computes with torch kernels on
host memory, which a CUDA-aware MPI may call with device pointers.  On this
transport they are computed in float32 instead: each 16-bit tensor gets a
float32 copy on the same device, MPI reduces those natively, and the result
is rounded back once (at least as accurate as summing in the 16-bit type;
twice the bytes on the wire).  Said once in the log, at INFO.
"""
from __future__ import annotations

import logging

import torch

from .streams import CudaStreams

log = logging.getLogger("hpccomm")

_HALF = (torch.float16, torch.bfloat16)


def _translate(result, back):
    """The op's result with each stand-in replaced by the user's tensor."""
    if isinstance(result, torch.Tensor):
        return back.get(id(result), result)
    if isinstance(result, (list, tuple)):
        return type(result)(_translate(r, back) for r in result)
    return result


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
    delegates = False  # runs hpccomm's own plans (plan)

    def __init__(self, device, reason: str, streams=None) -> None:
        self.device = device
        self.reason = reason
        self.streams = streams if streams is not None else CudaStreams()
        self._said_half = False

    def _widened(self, op, args):
        """``(args, pairs)``: float32 stand-ins for the call's 16-bit tensors,
        and ``(user tensor, stand-in, copy in, copy back)`` for each."""
        if not self._said_half:
            self._said_half = True
            log.info("hpccomm: float16/bfloat16 reductions of CUDA tensors over CUDA-aware MPI are computed in "
                     "float32 on the device (hpccomm's 16-bit reduction op runs on host memory)")
        pairs = []

        def wide(x, copy_in: bool, copy_back: bool):
            if isinstance(x, torch.Tensor):
                if x.dtype not in _HALF:
                    return x
                w = torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
                pairs.append((x, w, copy_in, copy_back))
                return w
            if isinstance(x, (list, tuple)):
                return type(x)(wide(y, copy_in, copy_back) for y in x)
            return x

        return [wide(a, i > 0 or op.first == "inout", i == 0) for i, a in enumerate(args)], pairs

    def plan(self, op, group, args):
        """``op``'s plan (hpccomm._ops.table) for device tensors ``args``: the op
        module's plan over a :class:`DeviceView` (its checks on the caller's
        thread), an event marking the caller's stream, and steps that wait for
        it before MPI reads, and leave no kernel pending when the op completes
        (hpccomm._gpu.streams).  A point-to-point op is posted at once: the
        caller's stream is waited for now.  Device plans keep the blocking form."""
        pairs = []
        if op.reducing and any(t.dtype in _HALF for t in tensors_in(args)):
            args, pairs = self._widened(op, args)
        call, cargs, icall, outputs, keep, before, after, nbytes = op.plan(DeviceView(group, "cuda"), *args)
        outputs = _translate(outputs, {id(w): x for x, w, _, _ in pairs})
        streams, device = self.streams, self.device
        if op.p2p:  # posted now, after the kernels this thread queued on the tensor
            streams.synchronize(device)
            return (call, cargs, icall, outputs, keep, before, after, nbytes)
        event = streams.record(device)  # (the op's steps run in ordered(), around its MPI call)

        def ordered(*mpi_args):
            streams.wait(event)  # the caller's kernels producing the inputs are done
            for x, w, copy_in, _ in pairs:
                if copy_in:
                    w.copy_(x)
            if before is not None:
                before()
            streams.synchronize(device)  # the op's own kernels (copies, scaling) are done before MPI reads
            try:
                call(*mpi_args)
                if after is not None:
                    after()
                for x, w, _, back in pairs:
                    if back:
                        x.copy_(w)
            finally:
                streams.synchronize(device)  # no kernel of the op is pending when it completes or fails

        return (ordered, cargs, None, outputs, (keep, pairs), None, None, nbytes)
