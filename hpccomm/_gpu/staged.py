"""Transport: staged through pinned host memory.

Each CUDA tensor of a call is given a host stand-in: a view of a pinned host
buffer that this transport keeps per group and device and reuses from call
to call (slot ``i`` serves the call's ``i``-th tensor; a slot is reallocated
only when a larger tensor comes).  The op module runs on the stand-ins
exactly as for CPU tensors; inputs are copied in before, outputs copied back
after.  Ops of one group run one at a time (hpccomm's order rule), so a slot
is never used by two ops at once.  Point-to-point ops stay pending after the
call returns, so they get buffers of their own instead.

Pipelined above :data:`PIPELINE_BYTES`: an all_reduce, broadcast or reduce of
one contiguous tensor goes in chunks of :data:`CHUNK_BYTES`, each chunk's MPI
call run as soon as its copy to the host has landed, while the next chunks are
still being copied in and the finished ones copied back (two side streams, one
each way; the host buffer is the whole tensor's, so no chunk's memory is
reused while a copy may still read it).  The three steps overlap instead of
running one after the other.

Chosen where neither CUDA-aware MPI nor NCCL can serve, or when asked for
(``HPCCOMM_GPU_TRANSPORT=staged``); said once in the log.
"""
from __future__ import annotations

import threading

import torch

from .._core.plan import run, steps
from .detect import translate
from .streams import CudaStreams


#: The smallest tensor (bytes) whose all_reduce, broadcast or reduce is pipelined, and the chunk size.
PIPELINE_BYTES = 4 << 20
CHUNK_BYTES = 4 << 20

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

    def __init__(self, device, reason: str, streams=None, alloc=pinned, copy=copy,
                 pipeline_bytes: int = PIPELINE_BYTES, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device = device
        self.reason = reason
        self.streams = streams if streams is not None else CudaStreams()
        self.alloc = alloc
        self.copy = copy
        self.buffers = HostBuffers(alloc)
        self.pipeline_bytes, self.chunk_bytes = pipeline_bytes, chunk_bytes

    def _stand_ins(self, op, args, buffers, rank: int):
        """``(host args, [(device tensor, host tensor, copy in, copy back)])``:
        the first argument's role is the op's in this call (its declaration,
        hpccomm._ops.op.Op.role); the others are inputs."""
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
        role = op.role(args, rank)
        for i, a in enumerate(args):
            if i == 0:
                out.append(host(a, role != "out", role != "in"))
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

    def plan(self, op, group, call, args):
        """The plan of ``op``'s checked ``call`` (hpccomm._ops.op) run on host
        stand-ins of device tensors ``args``: made on the caller's thread;
        then, where it runs, copy in, the CPU op, copy back.  A point-to-point op is
        posted at once and stays pending after the call returns: it gets host
        buffers of its own, copied in now (a receive's copied back once it
        arrived).  Staged plans keep the blocking form."""
        if op.p2p:
            host_args, pairs = self._stand_ins(op, args, None, group.rank)
            plan = op.plan(group, call, tuple(host_args))
            self.streams.synchronize(self.device)
            self._copy_in(pairs)
            call, cargs, icall, outputs, keep, before, after, nbytes = plan
            outputs = translate(outputs, {id(h): dev for dev, h, _, _ in pairs})
            # the host buffers MPI reads or writes: alive (in keep) until done
            return (call, cargs, icall, outputs, (keep, pairs), before, steps(after, lambda: self._copy_back(pairs)),
                    nbytes)
        host_args, pairs = self._stand_ins(op, args, self.buffers, group.rank)
        mpi_call, cargs, _, outputs, keep, before, after, nbytes = op.plan(group, call, tuple(host_args))
        if op.chunkable and len(pairs) == 1 and pairs[0][0].is_contiguous() and nbytes >= self.pipeline_bytes:
            return self._pipelined(op, group, call, args, pairs[0], outputs, keep, nbytes)
        event = self.streams.record(self.device)
        issuer = threading.get_ident()

        # On the caller's thread its stream orders the blocking copies after its kernels and before what it
        # queues next; on the comm thread (async_op=True) the caller's event is waited for, and the op leaves
        # nothing pending on the comm thread's stream.
        def staged_before():
            if threading.get_ident() != issuer:
                self.streams.wait(event)  # the caller's kernels producing the inputs are done
            self._copy_in(pairs)

        def staged_after():
            self._copy_back(pairs)
            if threading.get_ident() != issuer:
                self.streams.synchronize(self.device)

        return (mpi_call, cargs, None, translate(outputs, {id(h): dev for dev, h, _, _ in pairs}), (keep, pairs),
                steps(staged_before, before), steps(after, staged_after), nbytes)

    def _pipelined(self, op, group, call, args, pair, outputs, keep, nbytes: int):
        """The plan of ``op`` (a chunkable op: all_reduce, broadcast, reduce) on
        one contiguous device tensor, in chunks whose copies in, MPI calls and
        copies back overlap (see the module docstring).  The whole call was
        checked; each chunk's plan is the op's own on that chunk (its checked
        call's facts hold for any part of the tensor: the dtype's reduction,
        the root)."""
        dev, host, _, _ = pair
        flat_dev, flat_host = dev.view(-1), host.view(-1)
        step = max(self.chunk_bytes // max(dev.element_size(), 1), 1)
        bounds = [(i, min(i + step, flat_dev.numel())) for i in range(0, flat_dev.numel(), step)]
        writes = op.role(args, group.rank) != "in"  # (a root's broadcast, a reduce's others: read only)
        chunk_plans = [op.plan(group, call, ([flat_host[a:b]], *args[1:])) for a, b in bounds]
        streams, device = self.streams, self.device
        issued = streams.record(device)

        def pipeline():
            ready = [streams.copy_async(flat_host[a:b], flat_dev[a:b], issued) for a, b in bounds]
            back = None
            for (a, b), arrived, plan in zip(bounds, ready, chunk_plans):
                streams.wait(arrived)  # this chunk is in host memory; the next ones are still on their way
                run(plan)
                if writes:
                    back = streams.copy_async(flat_dev[a:b], flat_host[a:b], None, back=True)
            if back is not None:
                streams.wait(back)  # the last copy back (its stream's earlier ones with it) is done

        return (pipeline, (), None, translate(outputs, {id(host): dev}), (keep, pair, chunk_plans), None, None, nbytes)
