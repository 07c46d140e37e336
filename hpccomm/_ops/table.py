"""The one table of op properties: every op hpccomm runs, by torch's method.

Each entry says, once, what the op path and the GPU transports need to know
of an op: its name in messages, its plan function (its op module's: checks
every argument, returns the plan, see :mod:`hpccomm._core.plan`), its
argument checks alone (hpccomm._ops.arguments: what a transport that runs
the call itself checks, allocating nothing), whether it is point-to-point (a
peer waits for this rank, not every member), whether it reduces, what its first argument is to the op (``"out"``: written;
``"inout"``: read and written; ``"in"``: read), a reducing op's composed plan
(hpccomm._ops.composed: the GPU route ``composed``), and whether it has a
nonblocking form (posted as a nonblocking MPI call: point-to-point ops
always; the four collectives below with ``HPCCOMM_ASYNC_NONBLOCKING=1``, for
``async_op=True`` calls of up to ``hpccomm._ops.op_path.NONBLOCKING_MAX_BYTES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import alltoall, arguments, composed, gather, p2p, reduce, scatter


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op's entry (see the module docstring): what the op path and the transports know of it."""

    name: str
    plan: Callable
    check: Callable
    p2p: bool = False
    reducing: bool = False
    first: str = "out"
    nonblocking: bool = False
    composed: Optional[Callable] = None


A = arguments
ALL_REDUCE = OpSpec("all_reduce", reduce.all_reduce, A.all_reduce, reducing=True, first="inout", nonblocking=True,
                    composed=composed.all_reduce)
ALL_REDUCE_SPARSE = OpSpec("all_reduce", reduce.all_reduce_sparse, A.all_reduce, reducing=True, first="inout")
ALL_REDUCE_COALESCED = OpSpec("all_reduce_coalesced", reduce.all_reduce_coalesced, A.all_reduce_coalesced,
                              reducing=True, first="inout", composed=composed.all_reduce_coalesced)
REDUCE = OpSpec("reduce", reduce.reduce, A.reduce, reducing=True, first="inout", composed=composed.reduce)
REDUCE_SCATTER = OpSpec("reduce_scatter", reduce.reduce_scatter, A.reduce_scatter, reducing=True,
                        composed=composed.reduce_scatter)
REDUCE_SCATTER_TENSOR = OpSpec("reduce_scatter_tensor", reduce.reduce_scatter_tensor, A.reduce_scatter_tensor,
                               reducing=True, nonblocking=True, composed=composed.reduce_scatter_tensor)
REDUCE_SCATTER_TENSOR_COALESCED = OpSpec("reduce_scatter_tensor_coalesced", reduce.reduce_scatter_tensor_coalesced,
                                         A.reduce_scatter_tensor_coalesced, reducing=True,
                                         composed=composed.reduce_scatter_tensor_coalesced)
BROADCAST = OpSpec("broadcast", scatter.broadcast, A.broadcast, first="inout", nonblocking=True)
SCATTER = OpSpec("scatter", scatter.scatter, A.scatter)
ALL_GATHER = OpSpec("all_gather", gather.all_gather, A.all_gather)
ALL_GATHER_INTO_TENSOR = OpSpec("all_gather_into_tensor", gather.all_gather_into_tensor, A.all_gather_into_tensor,
                                nonblocking=True)
ALL_GATHER_COALESCED = OpSpec("all_gather_coalesced", gather.all_gather_coalesced, A.all_gather_coalesced)
ALL_GATHER_INTO_TENSOR_COALESCED = OpSpec("all_gather_into_tensor_coalesced", gather.all_gather_into_tensor_coalesced,
                                          A.all_gather_into_tensor_coalesced)
GATHER = OpSpec("gather", gather.gather, A.gather)
GATHER_SINGLE = OpSpec("gather_single", gather.gather_single, A.gather_single)
ALL_TO_ALL_SINGLE = OpSpec("all_to_all_single", alltoall.all_to_all_single, A.all_to_all_single)
ALL_TO_ALL = OpSpec("all_to_all", alltoall.alltoall, A.alltoall)
BARRIER = OpSpec("barrier", p2p.barrier, A.barrier)
SEND = OpSpec("send", p2p.send, A.send, p2p=True, first="in", nonblocking=True)
RECV = OpSpec("recv", p2p.recv, A.recv, p2p=True, nonblocking=True)
del A

#: Every op, by name (ALL_REDUCE_SPARSE shares its name with ALL_REDUCE).
OPS = {op.name: op for op in (ALL_REDUCE_SPARSE, ALL_REDUCE, ALL_REDUCE_COALESCED, REDUCE, REDUCE_SCATTER,
                              REDUCE_SCATTER_TENSOR, REDUCE_SCATTER_TENSOR_COALESCED, BROADCAST, SCATTER,
                              ALL_GATHER, ALL_GATHER_INTO_TENSOR, ALL_GATHER_COALESCED,
                              ALL_GATHER_INTO_TENSOR_COALESCED, GATHER, GATHER_SINGLE, ALL_TO_ALL_SINGLE,
                              ALL_TO_ALL, BARRIER, SEND, RECV)}
