"""Transport: staged through pinned host memory.

Each CUDA tensor of a call is given a host stand-in: a view of a pinned host
buffer that this transport keeps per group and device and reuses from call
to call (slot ``i`` serves the call's ``i``-th tensor; a slot is reallocated
only when a larger tensor comes).  The op module runs on the stand-ins
exactly as for CPU tensors; inputs are copied in before, outputs copied back
after.  Ops of one group run one at a time (hpccomm's order rule), so a slot
is never used by two ops at once.  Point-to-point ops stay pending after the
call returns, so they get buffers of their own instead.

Slow (two copies per tensor, and MPI on host memory): used only when asked
for (``HPCCOMM_GPU_TRANSPORT=staged``); said once in the log.
"""
from __future__ import annotations

import torch

from .._core.plan import steps
from .streams import CudaStreams


def pinned(nbytes: int) -> torch.Tensor:
    """Page-locked host memory: device copies from and to it are direct DMA."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A host-synchronous copy between device and host (``non_blocking=False``)."""
    dst.copy_(src)


class HostBuffers:
    """Reused host buffers, one per slot; ``allocations`` counts real allocations."""

    def __init__(self, alloc=pinned) -> None:
        self._alloc = alloc
        self._slots: list = []
        self.allocations = 0

    def view(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor shaped like ``like`` over slot ``slot``."""
        nbytes = like.numel() * like.element_size()
        while len(self._slots) <= slot:
            self._slots.append(None)
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._slots[slot] = self._alloc(max(nbytes, 64))
            self.allocations += 1
        return buf[:nbytes].view(like.dtype).view(like.shape)


class Staged:
    """Copies through reused pinned host buffers; see the module's docstring.

    ``alloc(nbytes)``, ``copy(dst, src)`` and ``streams`` are injectable: the
    unit tests run this transport for real on CPU tensors standing in for
    device tensors, and compare with the plain CPU op.
    """

    name = "staged"
    delegates = False  # runs hpccomm's own plans (plan)

    def __init__(self, device, reason: str, streams=None, alloc=pinned, copy=copy) -> None:
        self.device = device
        self.reason = reason
        self.streams = streams if streams is not None else CudaStreams()
        self.alloc = alloc
        self.copy = copy
        self.buffers = HostBuffers(alloc)

    def _stand_ins(self, op, args, buffers):
        """``(host args, [(device tensor, host tensor, copy in, copy back)])``:
        the first argument's role is the op's (hpccomm._ops.table); the others
        are inputs."""
        pairs: list = []

        def host(x, copy_in: bool, copy_back: bool):
            if isinstance(x, torch.Tensor):
                h = buffers.view(len(pairs), x) if buffers is not None else \
                    self.alloc(max(x.numel() * x.element_size(), 64))[:x.numel() * x.element_size()] \
                    .view(x.dtype).view(x.shape)
                pairs.append((x, h, copy_in, copy_back))
                return h
            if isinstance(x, list):
                return [host(y, copy_in, copy_back) for y in x]
            if isinstance(x, tuple):
                return tuple(host(y, copy_in, copy_back) for y in x)
            return x

        out = []
        for i, a in enumerate(args):
            if i == 0:
                out.append(host(a, op.first != "out", op.first != "in"))
            else:
                out.append(host(a, True, False))
        return out, pairs

    def _copy_in(self, pairs) -> None:
        for dev, h, copy_in, _ in pairs:
            if copy_in:
                self.copy(h, dev)

    def _copy_back(self, pairs) -> None:
        for dev, h, _, copy_back in pairs:
            if copy_back:
                self.copy(dev, h)

    def plan(self, op, group, args):
        """``op``'s plan (hpccomm._ops.table) run on host stand-ins of device
        tensors ``args``: the op module's checks on the caller's thread; then,
        where it runs, copy in, the CPU op, copy back.  A point-to-point op is
        posted at once and stays pending after the call returns: it gets host
        buffers of its own, copied in now (a receive's copied back once it
        arrived).  Staged plans keep the blocking form."""
        if op.p2p:
            host_args, pairs = self._stand_ins(op, args, None)
            plan = op.plan(group, *host_args)  # raises before any communication or copy
            self.streams.synchronize(self.device)
            self._copy_in(pairs)
            call, cargs, icall, outputs, keep, before, after, nbytes = plan
            outputs = _translate(outputs, {id(h): dev for dev, h, _, _ in pairs})
            # the host buffers MPI reads or writes: alive (in keep) until done
            return (call, cargs, icall, outputs, (keep, pairs), before, steps(after, lambda: self._copy_back(pairs)),
                    nbytes)
        host_args, pairs = self._stand_ins(op, args, self.buffers)
        call, cargs, _, outputs, keep, before, after, nbytes = op.plan(group, *host_args)
        event = self.streams.record(self.device)

        def staged_before():
            self.streams.wait(event)  # the caller's kernels producing the inputs are done
            self._copy_in(pairs)

        def staged_after():
            self._copy_back(pairs)
            self.streams.synchronize(self.device)

        return (call, cargs, None, _translate(outputs, {id(h): dev for dev, h, _, _ in pairs}), (keep, pairs),
                steps(staged_before, before), steps(after, staged_after), nbytes)


def _translate(result, to_device):
    """The op's result with each host stand-in replaced by its device tensor
    (a Work's future holds the user's tensors)."""
    if isinstance(result, torch.Tensor):
        return to_device.get(id(result), result)
    if isinstance(result, list):
        return [_translate(r, to_device) for r in result]
    if isinstance(result, tuple):
        return tuple(_translate(r, to_device) for r in result)
    return result
