"""The ``floor`` comparison: what torch.distributed itself costs a Python backend.

A backend with the least per-call work torch accepts: each method makes one
MPI call on the tensors' memory (the nonblocking form for ``async_op=True``
and point-to-point) and returns a Work, finished or holding the request, with
no argument checks, watchdog, trace, op numbers or GPU dispatch.  Timing
``dist.all_reduce`` etc. on it measures torch's own Python wrapper, C++
dispatch and Work handling around the same MPI call that the raw mpi4py
baseline makes.  No Python backend can do better through torch.distributed,
so ``hpccomm / floor`` is the share of the gap that is hpccomm's, and
``floor / raw mpi4py`` the share that is torch's API.

It comes in both of torch's routes, so that each hpccomm route is compared
with the floor of its own route (:func:`new_group` takes the route of
hpccomm's default group unless told):

- ``"pg"``: :class:`FloorGroup`, a whole ``dist.ProcessGroup`` subclass (the
  route of hpccomm's ProcessGroup adapter, every torch);
- ``"backend"``: :class:`FloorBackend`, a c10d ``Backend`` subclass that torch
  wraps in its own ProcessGroup and calls through its C++ ``PyBackend``
  trampoline (torch >= 2.14; the route of hpccomm's Backend adapter).

Either runs on the world's ranks or a subset of them (a subgroup is made by
its members only, with MPI_Comm_create_group).

Benchmark-only: it assumes what a real backend must check (contiguous CPU
tensors of a native MPI type, matching sizes on every rank) and supports only
the ops of the per-op cost targets (issue 15): all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, broadcast and send/recv,
blocking and ``async_op=True``.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

NAME = "hpccomm_bench_floor"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")
#: The two routes (see the module docstring).
ROUTES = ("pg", "backend")

_TYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int32: "INT32_T", torch.int64: "INT64_T",
          torch.int8: "INT8_T", torch.uint8: "UINT8_T"}


class _Work(dist.Work):
    """A Work born finished (``_req`` None) or completing an MPI request in
    ``wait()``; its future's value is the outputs (DDP-style callers read it).
    Made by :func:`_work` (no Python constructor frame)."""

    _req = None

    def wait(self, timeout=None) -> bool:
        if self._req is not None:
            self._req.Wait()
            self._req = None
        return True

    def is_completed(self) -> bool:
        return self._req is None or self._req.Test()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


def _work(outputs, req=None) -> _Work:
    work = _Work()
    work._outputs = outputs  # also keeps the tensors alive while MPI uses them
    if req is not None:
        work._req = req
    return work


class _FloorOps:
    """The op methods, shared by both routes; ``self.comm`` is the group's communicator."""

    def _setup(self, comm) -> None:
        from mpi4py import MPI

        self.comm = comm
        self._in_place = MPI.IN_PLACE
        self._fromaddress = MPI.buffer.fromaddress
        self._types = {d: (getattr(MPI, n), torch.empty((), dtype=d).element_size()) for d, n in _TYPES.items()}
        R = dist.ReduceOp
        # By the RedOpType's value: hashing or comparing torch's pybind enums costs
        # thousands of instructions, reading .value once the least there is.
        self._ops = [None] * 16
        for kind, op in ((R.SUM, MPI.SUM), (R.PRODUCT, MPI.PROD), (R.MIN, MPI.MIN), (R.MAX, MPI.MAX)):
            self._ops[kind.value] = op
        self._sum = MPI.SUM
        self._me = comm.Get_rank()
        self._name = NAME

    def _buf(self, t: torch.Tensor, count=None):
        """``[memory, count, type]``; mpi4py counts all-gather receives and
        reduce-scatter sends per rank (``count``)."""
        n = t.numel()
        mtype, size = self._types[t.dtype]
        return [self._fromaddress(t.data_ptr(), n * size), n if count is None else count, mtype]

    def allreduce(self, tensors, opts=None):
        op = self._ops[opts.reduceOp.op.value] if opts is not None else self._sum
        if opts is not None and opts.asyncOp:
            return _work(tensors, self.comm.Iallreduce(self._in_place, self._buf(tensors[0]), op=op))
        self.comm.Allreduce(self._in_place, self._buf(tensors[0]), op=op)
        return _work(tensors)

    def all_gather_single(self, output, input, opts=None):
        recv = self._buf(output, input.numel())
        if input.data_ptr() == output.data_ptr() + self._me * input.numel() * input.element_size():
            send = self._in_place
        else:
            send = self._buf(input)
        if opts is not None and opts.asyncOp:
            return _work([output], self.comm.Iallgather(send, recv))
        self.comm.Allgather(send, recv)
        return _work([output])

    def reduce_scatter_single(self, output, input, opts=None):
        op = self._ops[opts.reduceOp.op.value] if opts is not None else self._sum
        if opts is not None and opts.asyncOp:
            return _work([output], self.comm.Ireduce_scatter_block(self._buf(input, output.numel()),
                                                                    self._buf(output), op=op))
        self.comm.Reduce_scatter_block(self._buf(input, output.numel()), self._buf(output), op=op)
        return _work([output])

    def broadcast(self, tensors, opts):
        if opts.asyncOp:
            return _work(tensors, self.comm.Ibcast(self._buf(tensors[0]), root=opts.rootRank))
        self.comm.Bcast(self._buf(tensors[0]), root=opts.rootRank)
        return _work(tensors)

    # torch's dist.send/recv (blocking) call these and then wait() on the Work
    def send(self, tensors, dst: int, tag: int = 0):
        return _work(tensors, self.comm.Isend(self._buf(tensors[0]), dest=dst, tag=tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return _work(tensors, self.comm.Irecv(self._buf(tensors[0]), source=src, tag=tag))

    def getBackendName(self) -> str:
        return NAME


class FloorGroup(_FloorOps, dist.ProcessGroup):
    """The ``pg`` route: one MPI call per op, as a whole ProcessGroup."""

    def __init__(self, comm) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._setup(comm)

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    # torch's legacy names for the same ops
    _allgather_base = _FloorOps.all_gather_single
    _reduce_scatter_base = _FloorOps.reduce_scatter_single


def _backend_class():
    """:class:`FloorBackend`, made on first use: torch 2.13's ``Backend`` cannot be subclassed from Python."""
    from hpccomm import _compat

    global FloorBackend
    if FloorBackend is None:
        if not _compat.py_backend():
            raise RuntimeError(f"the floor's backend route needs torch >= 2.14 (a Python c10d Backend); "
                               f"this is torch {torch.__version__}")

        class _FloorBackend(_FloorOps, _compat.BackendBase):
            """The ``backend`` route: one MPI call per op, as a c10d Backend."""

            def __init__(self, comm) -> None:
                super().__init__(comm.Get_rank(), comm.Get_size())
                self._setup(comm)
                self._options = _compat.BackendOptions(NAME)

            @property
            def options(self):
                return self._options

        _FloorBackend.__name__ = _FloorBackend.__qualname__ = "FloorBackend"
        FloorBackend = _FloorBackend
    return FloorBackend


#: The Backend route's class (torch >= 2.14), made by :func:`_backend_class`.
FloorBackend = None


def supported(name: str, placement: str, asynchronous: bool, dtype: torch.dtype, redop: str):
    """None if the floor can run this case, else why not (decided from the
    arguments alone: the same on every rank)."""
    if name not in OPS:
        return f"floor: only {', '.join(OPS)} (the ops of the per-op cost targets)"
    if dtype not in _TYPES:
        return f"floor: no native MPI type for {dtype} here"
    if redop == "avg" and name in ("all_reduce", "reduce_scatter"):
        return "floor: MPI has no AVG"
    if name == "reduce_scatter" and placement != "out-of-place":
        return "floor: out-of-place reduce_scatter only (MPI's in-place layout differs from torch's)"
    return None


_route = ["pg"]  # the route the creator builds (set by new_group before torch calls it)


def _create(opts, backend_options=None):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = list(opts.global_ranks_in_group)
    if not ranks:
        comm = world.Dup()
    else:  # members only (torch calls the creator on members only): MPI_Comm_create_group
        group = world.Get_group().Incl(ranks)
        try:
            comm = world.Create_group(group, zlib.crc32(",".join(map(str, ranks)).encode()) % 32768)
        finally:
            group.Free()
    if _route[0] == "backend":
        return _backend_class()(comm)
    return FloorGroup(comm)


def route_of(group=None) -> str:
    """``"backend"`` when hpccomm serves ``group`` (default: the default group)
    with its c10d Backend adapter, else ``"pg"``."""
    from hpccomm import _compat

    pg = dist.group.WORLD if group is None else group
    if getattr(pg, "_g", None) is not None:  # hpccomm's ProcessGroup adapter is the group itself
        return "pg"
    return "backend" if _compat.group_of(pg) is not None else "pg"


def new_group(ranks=None, route=None):
    """A floor group over ``ranks`` (default every rank), by ``route``
    (``"pg"``, ``"backend"``; default: the route of hpccomm's default
    group).  Called by every rank, as ``dist.new_group``."""
    from ..._compat import register_backend

    route = route_of() if route is None else route
    if route not in ROUTES:
        raise ValueError(f"floor route {route!r}: choose from {', '.join(ROUTES)}")
    if route == "backend":
        _backend_class()  # refuses on torch 2.13, before any communication
    register_backend(NAME, _create, devices=["cpu"])  # once per process
    _route[0] = route
    return dist.new_group(ranks=ranks, backend=NAME)
