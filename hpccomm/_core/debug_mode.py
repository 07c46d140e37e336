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

Two things are compared: what must be equal on every rank (the op, dtypes,
sizes that must match, root, ReduceOp and the op number), and what each rank
says about sizes that may differ but must fit together (all_gather's list of
sizes against each rank's input, all_to_all's send counts against the
receivers' receive counts).  Either mismatch raises on every rank, naming
the ranks and sizes.
"""
from __future__ import annotations

import os

from .. import config
from ..errors import HpccommError
from . import flight


def enabled() -> bool:
    torch_level = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "")  # torch's own switch, honoured too
    return config.get("HPCCOMM_DEBUG") == "DETAIL" or torch_level.upper() == "DETAIL"


def _t(t) -> str:
    try:
        return f"{str(t.dtype).replace('torch.', '')}[{t.numel()}]"
    except AttributeError:
        return type(t).__name__


def _dt(t) -> str:
    try:
        return str(t.dtype).replace("torch.", "")
    except AttributeError:
        return type(t).__name__


def _redop(redop) -> str:
    kind = getattr(redop, "op", redop)
    return str(kind).split(".")[-1]


def _rows(t, splits, size: int):
    """Element counts per peer of all_to_all_single's ``t`` (None: unknown)."""
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() // rows if rows else 0
    if splits:
        return [int(s) * row for s in splits]
    return [rows // size * row] * size if size and rows % size == 0 else None


def describe(op: str, args, size: int = 0):
    """``(common, mine)`` for ``op`` called with ``args`` (the adapter's
    arguments after the group): ``common`` must be equal on every rank (a
    string); ``mine`` is this rank's part of a size relation checked across
    ranks (or None)."""
    mine = None
    try:
        if op in ("all_reduce", "broadcast", "reduce"):
            parts = [_t(args[0][0])] + [str(a) if isinstance(a, int) else _redop(a) for a in args[1:]]
        elif op == "all_reduce_coalesced":
            parts = [", ".join(_t(t) for t in args[0]), _redop(args[1])]
        elif op == "all_gather_into_tensor":
            parts = [_t(args[1])]
        elif op == "reduce_scatter_tensor":
            parts = [_t(args[0]), _redop(args[2])]
        elif op == "all_gather":  # inputs may differ in size; every rank's list must fit them
            parts = [_dt(args[1][0])]
            mine = ("all_gather", args[1][0].numel(), [t.numel() for t in args[0][0]])
        elif op == "all_gather_coalesced":
            parts = [", ".join(_t(t) for t in args[1])]
        elif op == "gather":
            parts = [_t(args[1][0]), str(args[2])]
        elif op == "gather_single":
            parts = [_t(args[1]), str(args[2])]
        elif op == "scatter":
            parts = [_t(args[0][0]), str(args[2])]
        elif op == "reduce_scatter":
            parts = [_t(args[0][0]), _redop(args[2])]
        elif op == "all_to_all_single":
            output, input, out_splits, in_splits = args[:4]
            parts = [_dt(input)]
            mine = ("all_to_all", _rows(input, in_splits, size), _rows(output, out_splits, size))
        elif op == "all_to_all":
            parts = [_dt(args[1][0])]
            mine = ("all_to_all", [t.numel() for t in args[1]], [t.numel() for t in args[0]])
        else:
            parts = []
    except (IndexError, TypeError, AttributeError):
        parts, mine = ["?"], None
    return f"{op}({', '.join(parts)})", mine


def check(group, op: str, args, seq: int, refused=None, asynchronous=None) -> None:
    """Compare op number ``seq`` across the group's ranks; raise on every
    rank if they differ.  ``refused``: the OpError this rank's own checks
    raised for the op (it joins the comparison so that every rank raises it,
    naming this rank, instead of the others waiting in MPI).
    ``asynchronous``: the op's ``async_op`` (None: not known here), which
    must be equal on every rank: outside debug mode an ``async_op=True``
    collective may be a nonblocking MPI call, which never matches a
    blocking one (the ranks would wait for each other forever)."""
    common, mine = describe(op, args, group.size)
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


def sizes_fit(group, facts) -> str:
    """What is wrong with the ranks' size facts (empty: nothing)."""
    if not facts or facts[0] is None or any(f is None or f[0] != facts[0][0] for f in facts):
        return ""
    g = group.global_ranks
    if facts[0][0] == "all_gather":
        inputs = [f[1] for f in facts]
        for r, (_, _, outs) in enumerate(facts):
            if outs != inputs:
                bad = next(k for k in range(len(inputs)) if k >= len(outs) or outs[k] != inputs[k])
                got = outs[bad] if bad < len(outs) else "no"
                return (f"rank {g[r]}'s tensor_list expects {got} elements from rank {g[bad]}, "
                        f"which sends {inputs[bad]}")
        return ""
    for i, (_, send, _) in enumerate(facts):  # all_to_all: i sends send[j] to j, who receives recv_j[i]
        if send is None:
            return f"rank {g[i]}'s input rows are not divisible by the group size {group.size}"
        for j, count in enumerate(send):
            recv = facts[j][2] if j < len(facts) else None
            if recv is None:
                return f"rank {g[j]}'s output rows are not divisible by the group size {group.size}"
            if j >= len(facts) or i >= len(recv) or recv[i] != count:
                got = recv[i] if i < len(recv) else "no"
                return f"rank {g[i]} sends {count} elements to rank {g[j]}, which expects {got} from it"
    return ""
