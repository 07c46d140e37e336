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
import threading

import torch

from .detect import tensors_in, translate
from .streams import CudaStreams

log = logging.getLogger("hpccomm")

_HALF = (torch.float16, torch.bfloat16)


class DeviceView:
    """A group as the op modules' plans see it on the device path: the same
    group, but its communicators (the collectives' and the point-to-point
    one) run ``ready()`` before every MPI call, so that a kernel the plan
    itself launched (a contiguous copy, a concatenation, PREMUL_SUM's
    scaling) is done before MPI reads the memory."""

    def __init__(self, group, ready) -> None:
        self._group = group
        self.comm = _Ordered(group.comm, ready)
        self.p2p = _Ordered(group.p2p, ready)
        self.calls = _Ordered(group.calls, ready)  # (the calls plans bind once per group)

    def __getattr__(self, name):
        return getattr(self._group, name)


class _Ordered:
    """A communicator whose MPI calls (mpi4py's capitalised methods) first run ``ready()``."""

    __slots__ = ("_comm", "_ready")

    def __init__(self, comm, ready) -> None:
        self._comm, self._ready = comm, ready

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not name[:1].isupper() or not callable(attr):
            return attr
        ready = self._ready

        def ordered(*args, **kwargs):
            ready()
            return attr(*args, **kwargs)

        return ordered


def _on_float32(facts):
    """A checked reducing call's facts for its float32 stand-ins: each
    float16/bfloat16 reduction (hpccomm._ops.checks.Reduction, alone or in
    a coalesced call's list) as float32's, the rest as they are."""
    if isinstance(facts, list):
        return [_on_float32(f) for f in facts]
    return facts.on(torch.float32) if getattr(facts, "dtype", None) in _HALF else facts


class CudaAwareMPI:
    """Hands device memory to MPI; see the module's docstring."""

    delegates = False  # runs hpccomm's own plans (plan)

    def __init__(self, device, reason: str, streams=None, composed: bool = False) -> None:
        self.device = device
        self.reason = reason
        self.streams = streams if streams is not None else CudaStreams()
        #: reductions through hpccomm's composition (hpccomm._ops.composed: the route ``composed``)
        self.composed = composed
        self.name = "composed" if composed else "mpi"
        self._said_half = False

    def _widened(self, op, args, rank: int):
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
                w = x.new_empty(x.shape, dtype=torch.float32)
                pairs.append((x, w, copy_in, copy_back))
                return w
            if isinstance(x, (list, tuple)):
                return type(x)(wide(y, copy_in, copy_back) for y in x)
            return x

        role = op.role(args, rank)
        return [wide(a, i > 0 or role != "out", i == 0 and role != "in") for i, a in enumerate(args)], pairs

    def plan(self, op, group, call, args):
        """The plan of ``op``'s checked ``call`` (hpccomm._ops.op) for device
        tensors ``args``: the op's plan (or its composed plan) over a
        :class:`DeviceView` (made on the caller's thread; every MPI call it
        makes waits for the running thread's stream first).  Run on the caller's thread, that is all it synchronises: the
        caller's kernels and the op's own are on the stream each MPI call
        waits for, and the kernels after MPI (AVG's division, write-backs) are
        on the caller's stream, ahead of whatever it queues next.  Run on the
        comm thread (``async_op=True``), it also waits for an event marking the
        caller's stream at issue, and leaves no kernel pending on its own
        stream when the op completes (hpccomm._gpu.streams).  A point-to-point
        op is posted at once.  Device plans keep the blocking form."""
        pairs = []
        planner = op.composed if self.composed and op.composed is not None else op.plan
        if planner is op.plan and op.reducing and any(t.dtype in _HALF for t in tensors_in(args)):
            args, pairs = self._widened(op, args, group.rank)  # (the composition reduces 16-bit floats itself)
            call = type(call)(call.signature, _on_float32(call.facts), False)  # (checked once: the user's call)
        streams, device = self.streams, self.device
        view = DeviceView(group, lambda: streams.synchronize(device))
        mpi_call, cargs, icall, outputs, keep, before, after, nbytes = planner(view, call, tuple(args))
        outputs = translate(outputs, {id(w): x for x, w, _, _ in pairs})
        if op.p2p:  # posted now (its MPI call waits for the stream), completed by its Work
            return (mpi_call, cargs, icall, outputs, keep, before, after, nbytes)
        event = streams.record(device)
        issuer = threading.get_ident()

        def ordered(*mpi_args):
            elsewhere = threading.get_ident() != issuer  # (the comm thread, for async_op=True: another stream)
            if elsewhere:
                streams.wait(event)  # the caller's kernels producing the inputs are done
            try:
                for x, w, copy_in, _ in pairs:
                    if copy_in:
                        w.copy_(x)
                if before is not None:
                    before()
                mpi_call(*mpi_args)  # (each MPI call waits for the kernels before it first)
                if after is not None:
                    after()
                for x, w, _, back in pairs:
                    if back:
                        x.copy_(w)
            finally:
                if elsewhere:
                    streams.synchronize(device)  # no kernel of the op is pending on this thread's stream

        return (ordered, cargs, None, outputs, (keep, pairs), None, None, nbytes)
