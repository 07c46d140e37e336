"""The torch-facing adapter: a ``torch.distributed.ProcessGroup`` whose ops run on MPI.

The only module with torch's method names.  Each method unpacks torch's
options, calls the op module, and wraps the result in a
:class:`hpccomm._work.Work`.  Blocking ops complete before they return;
point-to-point ops return a pending Work.
"""
from __future__ import annotations

import logging
import time
import types

from . import _compat, _debug, _engine, _mpi, _trace, _work
from .errors import HpccommError, OpError
from .gpu import dispatch as _gpu
from .ops import alltoall as _a2a
from .ops import gather as _gather
from .ops import p2p as _p2p
from .ops import reduce as _reduce
from .ops import scatter as _scatter
from ._compat import ProcessGroupBase, ReduceOp
from ._watchdog import watchdog

#: The backend name registered with torch at ``import hpccomm``:
#: ``dist.init_process_group(hpccomm.BACKEND_NAME)`` is ``dist.init_process_group("hpccomm")``.
BACKEND_NAME = "hpccomm"
_last_op = [None]  # (op, group, seq) of the latest collective: named when a rank dies
log = logging.getLogger("hpccomm")


def _nbytes(args) -> int:
    """Bytes in the tensors among an op's arguments (for the trace)."""
    total = 0
    for a in args:
        if isinstance(a, (list, tuple)):
            total += _nbytes(a)
        elif hasattr(a, "element_size") and hasattr(a, "numel"):
            total += a.numel() * a.element_size()
    return total


class ProcessGroupHpccomm(ProcessGroupBase):
    """A torch process group over one MPI communicator.

    Made by ``dist.init_process_group("hpccomm")``, ``dist.new_group`` and
    :func:`hpccomm.from_mpi4py`; not usually constructed directly.  Every
    ``torch.distributed`` call on the group becomes MPI calls on the group's
    own communicators.  An op called with arguments it cannot accept raises
    :class:`hpccomm.OpValueError` or :class:`hpccomm.OpTypeError` before any
    communication; a failure during communication raises
    :class:`hpccomm.HpccommError` naming the op.

    :param group: hpccomm's internal description of the group (communicators,
        ranks, timeout), made by the backend creator.

    Example::

        pg = dist.new_group([0, 1], backend="hpccomm")
        dist.all_reduce(t, group=pg)
        pg.mpi_comm.Get_size()        # the group's mpi4py communicator (do not free it)
    """

    def __init__(self, group) -> None:
        super().__init__(group.rank, group.size)
        self._g = group

    # -- plumbing -------------------------------------------------------------
    @property
    def mpi_comm(self):
        """The mpi4py communicator this group's collectives run on (owned by hpccomm)."""
        return self._g.comm

    def _run(self, op: str, prepare, *args, opts=None):
        """Check the op's arguments (``prepare``), then run it: here, or on the
        comm thread when torch asked for ``async_op=True``."""
        g = self._g
        if g.comm is None:
            raise HpccommError(f"hpccomm {op} (group '{g.name}'): the process group was destroyed")
        g.seq += 1
        devices = None
        try:
            device = _gpu.cuda_device(g, op, args)  # a call with CUDA tensors goes to a GPU transport
            if device is not None:
                devices = _gpu.future_devices(device)
                transport = _gpu.transport(g, op, device)
                work = _gpu.delegated(transport, g, op, args, opts)
                if work is not None:  # NCCL took the whole op
                    return work
                prepare = transport.wrap(op, prepare)
            run = prepare(g, *args)  # raises OpError before any communication
        except OpError:
            g.seq -= 1  # refused ops are not counted: op numbers stay equal on every rank
            raise
        if isinstance(run, _p2p.Pending):  # point-to-point: already posted, nonblocking
            return _work.Work(args[0], run, f"{op} ({g.where()})", devices)
        if g.debug:  # the fingerprint exchange is itself a collective: the timeout covers it
            token = watchdog.begin(g, op + " (debug-mode fingerprint check)", g.seq)
            try:
                _debug.check(g, op, args)
            finally:
                watchdog.end(token)
        asynchronous = opts is not None and getattr(opts, "asyncOp", False)
        engine = _engine.engine
        # On the comm thread (a callback of a finished op, such as a DDP hook) an op
        # runs at once: queuing it behind the thread's own work would deadlock.
        if (asynchronous or g.queued) and engine.usable() and not engine.on_comm_thread():
            job = _engine.Job(g, self._guarded(op, g, run, args))
            work = _work.Work(None, job, f"{op} ({g.where()})", devices)
            job.work = work
            _engine.engine.submit(job)
            if not asynchronous:  # queued only to keep this group's issue order
                work.wait()
            return work
        # The blocking path (latency-bound): call directly, no closure.  Every
        # microsecond here costs several in front of a cache-hot shared-memory
        # collective (docs/benchmarks.md), so nothing is formatted unless needed.
        return _work.Work(self._call(op, g, g.seq, run, args), devices=devices)

    @classmethod
    def _guarded(cls, op: str, g, run, args_for_trace=()):
        """``run`` wrapped for the comm thread, with the op number it has now."""
        seq = g.seq
        return lambda: cls._call(op, g, seq, run, args_for_trace)

    @staticmethod
    def _call(op: str, g, seq: int, run, args_for_trace):
        """Run an op's communication under the watchdog and the tracer; an MPI
        error becomes an HpccommError naming the op."""
        debug = log.isEnabledFor(logging.DEBUG)
        t0 = time.perf_counter() if debug else 0.0
        token = watchdog.begin(g, op, seq)
        _last_op[0] = (op, g, seq)
        tracer = _trace.active()
        start = _trace.now_ns() if tracer else 0
        try:
            result = run()
        except OpError:
            raise
        except _mpi.mpi().Exception as exc:
            raise HpccommError(f"hpccomm {op} ({g.where(seq)}): MPI failed: {exc}") from exc
        finally:
            watchdog.end(token)
            if tracer:
                tracer.record(op, g.name, seq, _nbytes(args_for_trace), start, _trace.now_ns())
        if debug:
            log.debug("%s (%s): %.1f us", op, g.where(seq), (time.perf_counter() - t0) * 1e6)
        return result

    @staticmethod
    def _redop(opts):
        return ReduceOp.SUM if opts is None else getattr(opts, "reduceOp", opts)

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._g.name

    def setGroupName(self, name: str) -> None:
        self._g.name = name

    def getGroupDesc(self) -> str:
        return self._g.desc

    def setGroupDesc(self, desc: str) -> None:
        self._g.desc = desc

    @property
    def group_name(self) -> str:
        return self._g.name

    def abort(self) -> None:
        """Abort every rank of the job: MPI state cannot be recovered."""
        _mpi.abort(1)

    def shutdown(self) -> None:
        """Free this group's MPI communicators (torch's destroy_process_group calls it)."""
        if self._g.comm is not None and self._g.is_world:
            _engine.engine.flush(self._g)
            _trace.finish(self._g.comm)  # every rank destroys the world: gather the trace now
        _gpu.release(self._g)
        self._g.free()

    # -- collectives ----------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        return self._run("all_reduce", _reduce.allreduce, tensors, self._redop(opts), opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._run("all_reduce_coalesced", _reduce.allreduce_coalesced, tensors, self._redop(opts), opts=opts)

    def reduce(self, tensors, opts):
        return self._run("reduce", _reduce.reduce, tensors, opts.rootRank, opts.reduceOp, opts=opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._run("reduce_scatter", _reduce.reduce_scatter, outputs, input_lists, self._redop(opts), opts=opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._run("reduce_scatter_tensor", _reduce.reduce_scatter_single, output, input, self._redop(opts), opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._run("reduce_scatter_tensor_coalesced", _reduce.reduce_scatter_single_coalesced,
                         outputs, inputs, self._redop(opts), opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def broadcast(self, tensors, opts):
        return self._run("broadcast", _scatter.broadcast, tensors, opts.rootRank, opts=opts)

    def scatter(self, outputs, input_lists, opts):
        return self._run("scatter", _scatter.scatter, outputs, input_lists, opts.rootRank, opts=opts)

    def allgather(self, output_lists, inputs, opts=None):
        return self._run("all_gather", _gather.allgather, output_lists, inputs, opts=opts)

    def all_gather_single(self, output, input, opts=None):
        return self._run("all_gather_into_tensor", _gather.all_gather_single, output, input, opts=opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._run("all_gather_coalesced", _gather.allgather_coalesced, output_lists, inputs, opts=opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run("all_gather_into_tensor_coalesced", _gather.all_gather_single_coalesced, outputs, inputs, opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, inputs, opts):
        return self._run("gather", _gather.gather, output_lists, inputs, opts.rootRank, opts=opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._run("all_to_all_single", _a2a.all_to_all_single, output, input,
                         output_split_sizes, input_split_sizes, opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        return self._run("all_to_all", _a2a.alltoall, outputs, inputs, opts=opts)

    def barrier(self, opts=None):
        return self._run("barrier", lambda g: (lambda: _p2p.barrier(g)), opts=opts)

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return self._run("send", _p2p.send, tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._run("recv", _p2p.recv, tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return self._run("recv", _p2p.recv, tensors, None, tag)


# Methods torch's C++ layer calls (the public ones and torch's legacy aliases): kept out of torch.compile.
_compat.hide_from_compiler(ProcessGroupHpccomm, [
    name for name, value in vars(ProcessGroupHpccomm).items()
    if isinstance(value, types.FunctionType) and (not name.startswith("_") or name.endswith("_base"))])
