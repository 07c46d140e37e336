"""Debug mode: before every collective, the ranks of the group compare what
they are about to do, and a mismatch raises on every rank, naming both sides.

On with ``HPCCOMM_DEBUG=DETAIL`` or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``;
off by default, when it costs one attribute test per op.  The comparison is
an allgather of a short description over the group's ``checks``
communicator (a duplicate that only checks use, see hpccomm._core.signatures), in the thread that runs
the op, so the check follows the op order.

A rank whose own checks refuse the op still takes part, with its refusal:
every rank then raises it, naming that rank (without debug mode such a
refusal is announced through the store and the watchdog ends the job, see
hpccomm._ops.op_path).

Two things are compared, both from the call's signature (declared with its
op, hpccomm._ops.op.Signature): what must be equal on every rank (the op,
dtypes, sizes that must match, root, ReduceOp, and the op number), and what
each rank says about sizes that may differ but must fit together
(all_to_all's send counts against the receivers' receive counts).  Either
mismatch raises on every rank, naming the ranks and sizes.
"""
from __future__ import annotations

import os

from .. import config
from ..errors import HpccommError
from . import flight


def enabled() -> bool:
    torch_level = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "")  # torch's own switch, honoured too
    return config.get("HPCCOMM_DEBUG") == "DETAIL" or torch_level.upper() == "DETAIL"


def compare(group, signature, seq: int, refused=None, asynchronous=None, op: str = "") -> None:
    """Compare op number ``seq`` across the group's ranks; raise on every
    rank if they differ.  ``signature``: the call's (hpccomm._ops.op.Signature),
    None for a call this rank's own checks refused: ``refused``, the OpError
    they raised (it joins the comparison so that every rank raises it, naming
    this rank, instead of the others waiting in MPI), of op ``op``.
    ``asynchronous``: the op's ``async_op`` (None: not known here), which
    must be equal on every rank: outside debug mode an ``async_op=True``
    collective may be a nonblocking MPI call, which never matches a
    blocking one (the ranks would wait for each other forever)."""
    if signature is None:
        common, mine = f"{op}(refused here)", None
    else:
        common, mine = signature.describe(), signature.pairs
    verdict = None if refused is None else (type(refused).__name__, str(refused))
    everyone = group.checks.comm.allgather((seq, common, mine, verdict, asynchronous))
    refusals = [(r, v) for r, (_, _, _, v, _) in enumerate(everyone) if v is not None]
    if refusals:
        r, (kind, text) = next(((r, v) for r, v in refusals if r == group.rank), refusals[0])
        if r == group.rank:
            raise refused
        raise HpccommError(f"hpccomm debug: {common} (op #{seq} on group '{group.name}', rank {group.rank}/"
                           f"{group.size}): rank {group.global_ranks[r]} refused this op ({kind}: {text})")
    first_seq, first, _, _, _ = everyone[0]
    for r, (s, what, _, _, _) in enumerate(everyone):
        if (s, what) != (first_seq, first):
            flight.dump_quietly(f"debug mode: the ranks called op #{seq} on group '{group.name}' differently")
            raise HpccommError(
                f"hpccomm debug: rank {group.global_ranks[r]} called {what} (op #{s} on group '{group.name}') "
                f"but rank {group.global_ranks[0]} called {first} (op #{first_seq}); this rank "
                f"({group.global_ranks[group.rank]}) called {common}. Every rank of a group must issue the same "
                "collectives in the same order with matching dtypes, sizes, roots and ReduceOps")
    flags = {e[4] for e in everyone if e[4] is not None}
    if len(flags) > 1:
        flight.dump_quietly(f"debug mode: async_op differs across ranks in op #{seq} on group '{group.name}'")
        g = group.global_ranks
        on = [g[r] for r, e in enumerate(everyone) if e[4] is True]
        off = [g[r] for r, e in enumerate(everyone) if e[4] is False]
        raise HpccommError(
            f"hpccomm debug: {common} (op #{seq} on group '{group.name}', rank {group.rank}/{group.size}): "
            f"async_op differs across ranks: rank(s) {', '.join(map(str, on))} passed async_op=True, rank(s) "
            f"{', '.join(map(str, off))} async_op=False. Pass the same async_op on every rank: hpccomm may run an "
            "async collective as a nonblocking MPI call, which MPI never matches with a blocking one "
            "(torch's gloo and NCCL do not require this; MPI does)")
    problem = sizes_fit(group, [e[2] for e in everyone])
    if problem:
        flight.dump_quietly(f"debug mode: sizes that do not fit in op #{seq} on group '{group.name}'")
        raise HpccommError(f"hpccomm debug: {common} (op #{seq} on group '{group.name}', rank {group.rank}/"
                           f"{group.size}): {problem}. The sizes each rank passes must fit together")


def sizes_fit(group, pairs) -> str:
    """What is wrong with the ranks' ``pairs`` (each rank's ``(sends,
    receives)`` per peer, hpccomm._ops.op.Signature.pairs; None where its op
    has none): rank i's send to j must be what j expects from i (empty:
    nothing)."""
    if not pairs or any(p is None for p in pairs):
        return ""
    g = group.global_ranks
    for i, (send, _) in enumerate(pairs):  # i sends send[j] to j, who receives recv_j[i]
        for j, count in enumerate(send):
            recv = pairs[j][1] if j < len(pairs) else ()
            if i >= len(recv) or recv[i] != count:
                got = recv[i] if i < len(recv) else "no"
                return f"rank {g[i]} sends {count} elements to rank {g[j]}, which expects {got} from it"
    return ""
