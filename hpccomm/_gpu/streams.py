"""CUDA stream ordering for transports that are not stream-aware (MPI).

MPI calls are host-synchronous and know nothing of CUDA streams, so:

1. when the op is issued (on the caller's thread), an event is recorded on
   the caller's current stream: it marks the end of the work that produces
   the op's inputs, without blocking the host (async ops return at once);
2. where the op runs (the caller's thread, or hpccomm's comm thread for
   ``async_op=True``), the host waits for that event before handing memory to
   MPI;
3. every MPI call of the op first waits for the running thread's current
   stream (the communicator of :class:`hpccomm._gpu.cuda_mpi.DeviceView`):
   the op's own kernels (contiguous copies, concatenations,
   premultiplication) are done before MPI reads their memory;
4. after MPI returns, the kernels the op queued on the running thread's
   stream (write-backs, AVG's division) are waited for before the op
   completes, so any work the user queues after ``wait()`` (or after a
   blocking call returns) sees the result.

:class:`CudaStreams` does this with torch.cuda; tests inject a recording fake
with the same three methods.
"""
from __future__ import annotations


class CudaStreams:
    """The stream operations a host-synchronous transport needs."""

    def __init__(self) -> None:
        self._side: dict = {}

    def record(self, device):
        """An event recorded on ``device``'s current stream of the calling thread."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def wait(self, event) -> None:
        """Block the host until ``event`` has happened."""
        event.synchronize()

    def synchronize(self, device) -> None:
        """Block the host until the calling thread's current stream on ``device`` is idle."""
        import torch

        torch.cuda.current_stream(device).synchronize()

    def copy_async(self, dst, src, after=None, back: bool = False):
        """Copy ``src`` into ``dst`` (one on the device, the other in pinned host
        memory) on a side stream, one for each direction (``back``: to the
        device), after ``after`` (an event, or None); returns an event marking
        the copy's end.  The caller keeps both tensors alive until then."""
        import torch

        device = src.device if src.is_cuda else dst.device
        key = (device, back)
        side = self._side.get(key)
        if side is None:
            side = self._side[key] = torch.cuda.Stream(device)
        if after is not None:
            side.wait_event(after)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event
