"""Debug mode: before every collective, the ranks of the group compare what
they are about to do, and a mismatch raises on every rank, naming both sides.

On with ``HPCCOMM_DEBUG=DETAIL`` or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``;
off by default, when it costs one attribute test per op.  The comparison is
an allgather of a short description over the group's point-to-point
communicator (a separate context from the op's own), in the calling thread,
so the check follows issue order.
"""
from __future__ import annotations

import os

from . import config
from .errors import HpccommError


def enabled() -> bool:
    torch_level = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "")  # torch's own switch, honoured too
    return config.get("HPCCOMM_DEBUG") == "DETAIL" or torch_level.upper() == "DETAIL"


def _t(t) -> str:
    try:
        return f"{str(t.dtype).replace('torch.', '')}[{t.numel()}]"
    except AttributeError:
        return type(t).__name__


def _redop(redop) -> str:
    kind = getattr(redop, "op", redop)
    return str(kind).split(".")[-1]


def describe(op: str, args) -> str:
    """What must agree across ranks for ``op`` called with ``args`` (the
    adapter's arguments after the group): dtypes, sizes that must match, roots
    and ReduceOps; not sizes that may differ per rank (all_gather lists,
    all_to_all splits, a root's lists)."""
    try:
        if op in ("all_reduce", "broadcast", "reduce"):
            parts = [_t(args[0][0])] + [str(a) if isinstance(a, int) else _redop(a) for a in args[1:]]
        elif op == "all_reduce_coalesced":
            parts = [", ".join(_t(t) for t in args[0]), _redop(args[1])]
        elif op == "all_gather_into_tensor":
            parts = [_t(args[1])]
        elif op == "reduce_scatter_tensor":
            parts = [_t(args[0]), _redop(args[2])]
        elif op in ("all_gather", "gather"):
            parts = [str(args[1][0].dtype).replace("torch.", "")] + [str(a) for a in args[2:]]
        elif op == "scatter":
            parts = [str(args[0][0].dtype).replace("torch.", ""), str(args[2])]
        elif op == "reduce_scatter":
            parts = [str(args[0][0].dtype).replace("torch.", ""), _redop(args[2])]
        elif op in ("all_to_all_single", "all_to_all"):
            first = args[1] if op == "all_to_all_single" else args[1][0]
            parts = [str(first.dtype).replace("torch.", "")]
        else:
            parts = []
    except (IndexError, TypeError, AttributeError):
        parts = ["?"]
    return f"{op}({', '.join(parts)})"


def check(group, op: str, args) -> None:
    """Compare this op across the group's ranks; raise on every rank if they differ."""
    mine = describe(op, args)
    everyone = group.p2p.allgather((group.seq, mine))
    first_seq, first = everyone[0]
    for r, (seq, what) in enumerate(everyone):
        if (seq, what) != (first_seq, first):
            raise HpccommError(
                f"hpccomm debug: rank {group.global_ranks[r]} called {what} (op #{seq} on group '{group.name}') "
                f"but rank {group.global_ranks[0]} called {first} (op #{first_seq}); this rank "
                f"({group.global_ranks[group.rank]}) called {mine}. Every rank of a group must issue the same "
                "collectives in the same order with matching dtypes, sizes, roots and ReduceOps")
