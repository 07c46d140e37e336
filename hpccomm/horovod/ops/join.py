"""``hvd.join``: a rank out of data takes part in the other ranks' reductions
with zeros until every rank has joined.

It sits above :mod:`hpccomm.horovod.optimizer`: a joined rank also feeds
zeros into DistributedOptimizer's reductions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import optimizer
from ..process_sets import ProcessSet, global_process_set, member
from .allreduce import start_allreduce
from .checks import OP_NAMES
from .negotiation import BARRIER, OPTIMIZER, join_negotiate


def _feed(ps: ProcessSet, desc, device, started: list) -> None:
    """As a joined rank, take part in ``desc``'s data step with zeros
    (DistributedOptimizer's reductions are started into ``started``, not waited)."""
    kind = desc[0]
    if kind == BARRIER:
        dist.barrier(group=ps._data)
        return
    if kind == OPTIMIZER:
        started.extend(optimizer.feed_round(desc, device))
        return
    params = dict(desc[2])
    op = next(o for o, n in OP_NAMES.items() if n == params["op"])
    zeros = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for dtype, shape, _ in desc[3]]
    start_allreduce(ps, zeros, op, params["prescale_factor"], params["postscale_factor"]).wait()


def join(device=-1) -> int:
    """Say this rank has no more data: until every rank has joined, it takes
    part in the other ranks' allreduces (and DistributedOptimizer's) with
    zeros, as Horovod does; returns the global rank that joined last.

    An Average still divides by the full size. Broadcast, allgather, alltoall
    and reducescatter raise on the other ranks while a rank has joined
    (Horovod's rule).

    :param device: where the zeros live: -1 (CPU, default) or a CUDA device index.
    :raises ValueError: Horovod is not initialised.

    Example::

        for batch in my_uneven_share_of_the_data:
            train_step(batch)
        last = hvd.join()
    """
    ps = member(global_process_set, "join")
    where = torch.device("cpu") if device is None or device < 0 else torch.device("cuda", device)
    joined_at = ps.negotiations + 1
    started: list = []  # the optimizer reductions fed (waited once every rank has joined)
    while True:
        done, last, desc = join_negotiate(ps, joined_at)
        if done:
            break
        if desc is not None:
            _feed(ps, desc, where, started)
    for pending in started:
        pending.wait()
    return last
