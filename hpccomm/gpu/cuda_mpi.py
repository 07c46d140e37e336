"""Transport: CUDA-aware MPI.

The op modules run unchanged on device tensors: their MPI buffers are built
from ``data_ptr()`` (``hpccomm._mpi.buffer``), which for a CUDA tensor is a
device pointer that a CUDA-aware MPI library reads and writes directly
(GPUDirect where the hardware has it).  The ops see the group through a
:class:`DeviceView`, which lets their checks accept tensors of that device.

Stream ordering is described in :mod:`hpccomm.gpu.streams`.

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

from ..ops.p2p import Pending
from .streams import CudaStreams

log = logging.getLogger("hpccomm")

#: Ops that reduce (their 16-bit float tensors are widened to float32).
REDUCING = frozenset({"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                      "reduce_scatter_tensor_coalesced"})
_HALF = (torch.float16, torch.bfloat16)
#: Reductions whose first argument is read as well as written.
_IN_OUT = frozenset({"all_reduce", "all_reduce_coalesced", "reduce"})


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

    host = False  # device memory: MPI buffers made with hpccomm._mpi.buffer (which orders streams)

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
    delegates = False  # runs hpccomm's own ops (wrap)

    def __init__(self, device, reason: str, streams=None) -> None:
        self.device = device
        self.reason = reason
        self.streams = streams if streams is not None else CudaStreams()
        self._said_half = False

    def _widened(self, op: str, prepare):
        """``prepare`` for float32 stand-ins of the call's 16-bit tensors: the
        op module checks them now; the run casts up, reduces, casts back."""
        if not self._said_half:
            self._said_half = True
            log.info("hpccomm: float16/bfloat16 reductions of CUDA tensors over CUDA-aware MPI are computed in "
                     "float32 on the device (hpccomm's 16-bit reduction op runs on host memory)")

        def prepared(group, *args):
            pairs = []  # (user tensor, float32 stand-in, copy in, copy back)

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

            wide_args = [wide(a, i > 0 or op in _IN_OUT, i == 0) for i, a in enumerate(args)]
            run = prepare(group, *wide_args)  # raises before any communication
            back = {id(w): x for x, w, _, _ in pairs}

            def widened():
                for x, w, copy_in, _ in pairs:
                    if copy_in:
                        w.copy_(x)
                result = run()
                for x, w, _, copy_back in pairs:
                    if copy_back:
                        x.copy_(w)
                return _translate(result, back)

            return widened

        return prepared

    def wrap(self, op: str, prepare):
        """``prepare`` (an op module's function) for device tensors: checks on
        the caller's thread, an event marking the caller's stream, and a run
        that waits for it and leaves no kernel pending when it returns."""
        def prepared(group, *args):
            inner = prepare
            if op in REDUCING and any(t.dtype in _HALF for t in tensors_in(args)):
                inner = self._widened(op, prepare)
            run = inner(DeviceView(group, "cuda"), *args)
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
