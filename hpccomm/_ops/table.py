"""The one table of op properties: every op hpccomm runs, by torch's method.

Each entry says, once, what the op path and the GPU transports need to know
of an op: its name in messages, its plan function (its op module's: checks
every argument, returns the plan, see :mod:`hpccomm._ops.plan`), whether it
is point-to-point (a peer waits for this rank, not every member), whether it
reduces, what its first argument is to the op (``"out"``: written;
``"inout"``: read and written; ``"in"``: read), and whether it has a
nonblocking form (posted as a nonblocking MPI call: point-to-point ops
always; the four collectives below with ``HPCCOMM_ASYNC_NONBLOCKING=1``, for
``async_op=True`` calls of up to ``hpccomm._core.op_path.NONBLOCKING_MAX_BYTES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import alltoall, composed, gather, p2p, reduce, scatter


@dataclass(frozen=True, slots=True)
class Op:
    name: str
    plan: Callable
    p2p: bool = False
    reducing: bool = False
    first: str = "out"
    nonblocking: bool = False
    #: a reducing op's plan composed of point-to-point messages and local arithmetic
    #: (hpccomm._ops.composed: the GPU route ``composed``), None for the others
    composed: Optional[Callable] = None


ALL_REDUCE = Op("all_reduce", reduce.all_reduce, reducing=True, first="inout", nonblocking=True,
                composed=composed.all_reduce)
ALL_REDUCE_SPARSE = Op("all_reduce", reduce.all_reduce_sparse, reducing=True, first="inout")
ALL_REDUCE_COALESCED = Op("all_reduce_coalesced", reduce.all_reduce_coalesced, reducing=True, first="inout",
                          composed=composed.all_reduce_coalesced)
REDUCE = Op("reduce", reduce.reduce, reducing=True, first="inout", composed=composed.reduce)
REDUCE_SCATTER = Op("reduce_scatter", reduce.reduce_scatter, reducing=True, composed=composed.reduce_scatter)
REDUCE_SCATTER_TENSOR = Op("reduce_scatter_tensor", reduce.reduce_scatter_tensor, reducing=True, nonblocking=True,
                           composed=composed.reduce_scatter_tensor)
REDUCE_SCATTER_TENSOR_COALESCED = Op("reduce_scatter_tensor_coalesced", reduce.reduce_scatter_tensor_coalesced,
                                     reducing=True, composed=composed.reduce_scatter_tensor_coalesced)
BROADCAST = Op("broadcast", scatter.broadcast, first="inout", nonblocking=True)
SCATTER = Op("scatter", scatter.scatter)
ALL_GATHER = Op("all_gather", gather.all_gather)
ALL_GATHER_INTO_TENSOR = Op("all_gather_into_tensor", gather.all_gather_into_tensor, nonblocking=True)
ALL_GATHER_COALESCED = Op("all_gather_coalesced", gather.all_gather_coalesced)
ALL_GATHER_INTO_TENSOR_COALESCED = Op("all_gather_into_tensor_coalesced", gather.all_gather_into_tensor_coalesced)
GATHER = Op("gather", gather.gather)
GATHER_SINGLE = Op("gather_single", gather.gather_single)
ALL_TO_ALL_SINGLE = Op("all_to_all_single", alltoall.all_to_all_single)
ALL_TO_ALL = Op("all_to_all", alltoall.alltoall)
BARRIER = Op("barrier", p2p.barrier)
SEND = Op("send", p2p.send, p2p=True, first="in", nonblocking=True)
RECV = Op("recv", p2p.recv, p2p=True, nonblocking=True)

#: Every op, by name (ALL_REDUCE_SPARSE shares its name with ALL_REDUCE).
OPS = {op.name: op for op in (ALL_REDUCE_SPARSE, ALL_REDUCE, ALL_REDUCE_COALESCED, REDUCE, REDUCE_SCATTER,
                              REDUCE_SCATTER_TENSOR, REDUCE_SCATTER_TENSOR_COALESCED, BROADCAST, SCATTER,
                              ALL_GATHER, ALL_GATHER_INTO_TENSOR, ALL_GATHER_COALESCED,
                              ALL_GATHER_INTO_TENSOR_COALESCED, GATHER, GATHER_SINGLE, ALL_TO_ALL_SINGLE,
                              ALL_TO_ALL, BARRIER, SEND, RECV)}
