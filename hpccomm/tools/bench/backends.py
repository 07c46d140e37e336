"""The three ways the sweep runs an op: hpccomm and gloo through torch.distributed,
and raw mpi4py calls on numpy views of the same buffers (the limit hpccomm is
measured against).  Each ``call_*`` returns a no-argument function doing one
op, or raises :class:`Unsupported` with the reason (the same on every rank, so
no rank is left waiting in a collective)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .ops import IP, Case

TAG = 4242  # ping-pong tag: apart from anything else on the benchmark's communicator


class Unsupported(Exception):
    """This backend cannot run this case (say why in the message)."""


def _redop(name: str):
    return getattr(dist.ReduceOp, {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX",
                                   "avg": "AVG"}[name])


def call_torch(case: Case, group, backend: str, asynchronous: bool, redop: str, root: int):
    """One op through torch.distributed on ``group`` (None: the default hpccomm group)."""
    t, name, a = case.tensors, case.spec.name, asynchronous
    if backend == "gloo" and case.spec.reduces and redop == "avg":
        raise Unsupported("gloo has no ReduceOp.AVG")
    if backend == "gloo" and name == "all_to_all" and case.placement == IP:
        # Seen by this benchmark's check: gloo's all_to_all_single writes its output while
        # still reading the input, so with output is input the result is wrong.
        raise Unsupported("gloo's all_to_all_single gives wrong results when output is input")
    op = _redop(redop)
    if name == "all_reduce":
        fn = lambda: dist.all_reduce(t["buf"], op=op, group=group, async_op=a)  # noqa: E731
    elif name == "all_gather":
        fn = lambda: dist.all_gather_into_tensor(t["out"], t["inp"], group=group, async_op=a)  # noqa: E731
    elif name == "reduce_scatter":
        fn = lambda: dist.reduce_scatter_tensor(t["out"], t["inp"], op=op, group=group, async_op=a)  # noqa: E731
    elif name == "all_to_all":
        fn = lambda: dist.all_to_all_single(t["out"], t["inp"], group=group, async_op=a)  # noqa: E731
    elif name == "broadcast":
        fn = lambda: dist.broadcast(t["buf"], src=root, group=group, async_op=a)  # noqa: E731
    elif name == "reduce":
        fn = lambda: dist.reduce(t["buf"], dst=root, op=op, group=group, async_op=a)  # noqa: E731
    elif name == "gather":
        fn = lambda: dist.gather(t["inp"], gather_list=t.get("out_list"), dst=root,  # noqa: E731
                                 group=group, async_op=a)
    elif name == "scatter":
        fn = lambda: dist.scatter(t["out"], scatter_list=t.get("inp_list"), src=root,  # noqa: E731
                                  group=group, async_op=a)
    elif name == "barrier":
        fn = lambda: dist.barrier(group=group, async_op=a)  # noqa: E731
    elif name == "sendrecv":
        return _torch_pingpong(case, group, a)
    else:
        raise Unsupported(f"no torch call for {name}")
    if a:
        return lambda: fn().wait()
    return fn


def _torch_pingpong(case: Case, group, asynchronous: bool):
    t, peer = case.tensors, case.tensors["partner"]
    if case.role == "idle":
        return lambda: None
    if asynchronous:
        send = lambda b: dist.isend(b, dst=peer, group=group, tag=TAG).wait()  # noqa: E731
        recv = lambda b: dist.irecv(b, src=peer, group=group, tag=TAG).wait()  # noqa: E731
    else:
        send = lambda b: dist.send(b, dst=peer, group=group, tag=TAG)  # noqa: E731
        recv = lambda b: dist.recv(b, src=peer, group=group, tag=TAG)  # noqa: E731
    buf = t["buf"]
    if case.role == "ping":
        back = t["back"]
        return lambda: (send(buf), recv(back))
    return lambda: (recv(buf), send(buf))


#: dtypes raw mpi4py handles here: numpy views (.numpy()) with a native MPI type.
RAW_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8)


def call_mpi(case: Case, comm, asynchronous: bool, redop: str, root: int, dtype: torch.dtype):
    """One op as raw mpi4py calls on numpy views of the case's buffers:
    the blocking call, or its nonblocking form (``I...``) and ``Wait``."""
    from mpi4py import MPI  # a tool may import mpi4py inside a function (hpccomm started MPI)

    if dtype not in RAW_DTYPES:
        raise Unsupported(f"raw mpi4py: no native MPI type for {dtype} here (numpy has no bfloat16; "
                          "MPI's float16 reductions are not portable)")
    if case.spec.reduces and redop == "avg":
        raise Unsupported("raw mpi4py: MPI has no AVG")
    n = {k: v.numpy() for k, v in case.tensors.items() if isinstance(v, torch.Tensor)}
    op = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}.get(redop, MPI.SUM)
    rank, name, ip, nb = comm.Get_rank(), case.spec.name, case.placement == IP, asynchronous
    IN_PLACE = MPI.IN_PLACE

    def call(blocking, nonblocking, *args, **kw):
        if nb:
            start = functools.partial(getattr(comm, nonblocking), *args, **kw)
            return lambda: start().Wait()
        return functools.partial(getattr(comm, blocking), *args, **kw)  # no Python frame per call

    if name == "all_reduce":
        return call("Allreduce", "Iallreduce", IN_PLACE, n["buf"], op=op)
    if name == "all_gather":
        return call("Allgather", "Iallgather", IN_PLACE if ip else n["inp"], n["out"])
    if name == "reduce_scatter":
        if ip:
            raise Unsupported("raw mpi4py: MPI's in-place Reduce_scatter_block keeps the result at the "
                              "buffer's start, not at this rank's piece")
        return call("Reduce_scatter_block", "Ireduce_scatter_block", n["inp"], n["out"], op=op)
    if name == "all_to_all":
        return call("Alltoall", "Ialltoall", IN_PLACE if ip else n["inp"], n["out"])
    if name == "broadcast":
        return call("Bcast", "Ibcast", n["buf"], root=root)
    if name == "reduce":
        if rank == root:
            return call("Reduce", "Ireduce", IN_PLACE, n["buf"], op=op, root=root)
        return call("Reduce", "Ireduce", n["buf"], None, op=op, root=root)
    if name == "gather":
        if rank == root:
            return call("Gather", "Igather", IN_PLACE if ip else n["inp"], n["out"], root=root)
        return call("Gather", "Igather", n["inp"], None, root=root)
    if name == "scatter":
        if rank == root:
            return call("Scatter", "Iscatter", n["inp"], IN_PLACE if ip else n["out"], root=root)
        return call("Scatter", "Iscatter", None, n["out"], root=root)
    if name == "barrier":
        return call("Barrier", "Ibarrier")
    if name == "sendrecv":
        peer = case.tensors["partner"]
        if case.role == "idle":
            return lambda: None
        if nb:
            send = lambda b: comm.Isend(b, dest=peer, tag=TAG).Wait()  # noqa: E731
            recv = lambda b: comm.Irecv(b, source=peer, tag=TAG).Wait()  # noqa: E731
        else:
            send = lambda b: comm.Send(b, dest=peer, tag=TAG)  # noqa: E731
            recv = lambda b: comm.Recv(b, source=peer, tag=TAG)  # noqa: E731
        if case.role == "ping":
            buf, back = n["buf"], n["back"]
            return lambda: (send(buf), recv(back))
        buf = n["buf"]
        return lambda: (recv(buf), send(buf))
    raise Unsupported(f"no raw MPI call for {name}")
