"""The agreement step every op takes before its data moves (step 1 in
:mod:`hpccomm.horovod.ops`), and a joined rank's side of it."""
from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from ..basics import HorovodInternalError
from ..process_sets import ProcessSet
from .checks import where

#: The kinds of agreement-step description (``desc[0]``) that a joined rank answers in its own way
#: (hpccomm.horovod.ops.join): Horovod's barrier, and a DistributedOptimizer round.
BARRIER, OPTIMIZER = "barrier", "optimizer"
#: ops that ranks which have joined can take part in (Horovod's rule).
JOIN_OK = ("allreduce", "grouped_allreduce", BARRIER, OPTIMIZER)

# torch 2.13 renamed all_gather_into_tensor (the old name warns)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor_desc(t: torch.Tensor, skip_dim0: bool = False):
    """A tensor as the agreement step compares it: dtype, shape (``None`` first
    with ``skip_dim0``: it may differ between ranks) and device type."""
    shape = (None, *t.shape[1:]) if skip_dim0 else tuple(t.shape)
    return (str(t.dtype).replace("torch.", ""), shape, t.device.type)


def _text(desc) -> str:
    """A description as a user reads it: ``allreduce('loss', float32[4], Average)``."""
    kind, name, params, tensors = desc
    parts = [repr(name)] if name else []
    for dtype, shape, device in tensors:
        dims = ", ".join("*" if d is None else str(d) for d in shape)
        parts.append(f"{dtype}[{dims}]" + ("" if device == "cpu" else f" on {device}"))
    parts += [f"{k}={v}" for k, v in params]
    return f"{kind}({', '.join(parts)})"


def _hash(desc) -> int:
    digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _differences(a, b) -> str:
    """What differs between two descriptions, in words."""
    if a[0] != b[0]:
        return "different ops"
    if a[1] != b[1]:
        return "different names"
    if len(a[3]) != len(b[3]):
        return "different numbers of tensors"
    if [t[0] for t in a[3]] != [t[0] for t in b[3]]:
        return "mismatched dtypes"
    if [t[2] for t in a[3]] != [t[2] for t in b[3]]:
        return "mismatched devices"
    if [len(t[1]) for t in a[3]] != [len(t[1]) for t in b[3]]:
        return "mismatched numbers of dimensions"
    if [t[1] for t in a[3]] != [t[1] for t in b[3]]:
        return "mismatched shapes"
    da, db = dict(a[2]), dict(b[2])
    return "mismatched " + ", ".join(k for k in da if da.get(k) != db.get(k))  # the only part left to differ


def _exchange(ps: ProcessSet, state: int, digest: int, size0: int) -> list:
    """Every rank's ``(state, digest, size0)``, in set order: the one small allgather of an agreement step."""
    n = len(ps.ranks)
    rows = torch.empty(3 * n, dtype=torch.int64)
    all_gather_single(rows, torch.tensor([state, digest, size0], dtype=torch.int64), group=ps._ctrl)
    ps.negotiations += 1
    return rows.view(n, 3).tolist()


def negotiate(ps: ProcessSet, desc, error: Optional[BaseException] = None, size0: int = 0) -> list:
    """The agreement step (:mod:`hpccomm.horovod.ops`); returns every rank's ``size0``.

    Raises on every rank of the set when an input was refused, the
    descriptions differ, or ranks have joined and ``desc`` cannot run then."""
    kind, name = desc[0], desc[1]
    n = len(ps.ranks)
    rows = _exchange(ps, -1 if error is not None else 0, _hash(desc), size0)
    states = [r[0] for r in rows]
    if all(s == 0 for s in states) and all(r[1] == rows[0][1] for r in rows):
        return [r[2] for r in rows]
    infos = [None] * n
    dist.all_gather_object(infos, (desc, None if error is None else f"{type(error).__name__}: {error}"),
                           group=ps._ctrl)
    here = where(kind, ps, name)
    if error is not None:
        raise error
    refused = [i for i, s in enumerate(states) if s < 0]
    if refused:
        first = refused[0]
        raise HorovodInternalError(
            f"{here}: the input of rank(s) {[ps.ranks[i] for i in refused]} was refused, so this op cannot run "
            f"(rank {ps.ranks[first]}: {infos[first][1]})")
    active = [i for i, s in enumerate(states) if s == 0]
    joined = [ps.ranks[i] for i, s in enumerate(states) if s > 0]
    for i in active:
        if infos[i][0] != infos[active[0]][0]:
            a, b = active[0], i
            raise HorovodInternalError(
                f"{here}: {_differences(infos[a][0], infos[b][0])} across ranks: rank {ps.ranks[a]} called "
                f"{_text(infos[a][0])} but rank {ps.ranks[b]} called {_text(infos[b][0])}. Every rank must call the "
                "same ops in the same order with the same dtypes, shapes and arguments (hpccomm.horovod matches "
                "ops by their order, where Horovod matched them by name)")
    if joined and kind not in JOIN_OK:
        raise HorovodInternalError(
            f"{here}: {kind} is not supported while ranks have joined (rank(s) {joined} called hvd.join()); as "
            "in Horovod, only allreduce, grouped_allreduce, barrier and DistributedOptimizer's reductions are")
    return [r[2] for r in rows]


def join_negotiate(ps: ProcessSet, joined_at: int):
    """A joined rank's side of one agreement step: ``(done, last_rank, desc)``."""
    n = len(ps.ranks)
    states = [r[0] for r in _exchange(ps, joined_at, 0, 0)]
    if all(s > 0 for s in states):
        last = max(range(n), key=lambda i: (states[i], i))  # ties: the highest rank, as Horovod's controller
        return True, ps.ranks[last], None
    infos = [None] * n
    dist.all_gather_object(infos, (None, None), group=ps._ctrl)
    active = [i for i, s in enumerate(states) if s <= 0]
    if any(states[i] < 0 for i in active) or any(infos[i][0] != infos[active[0]][0] for i in active):
        return False, None, None  # the active ranks raise; nothing to feed
    desc = infos[active[0]][0]
    return False, None, (desc if desc[0] in JOIN_OK else None)
