"""``hvd.barrier``."""
from __future__ import annotations

import torch.distributed as dist

from ..process_sets import global_process_set, member
from .negotiation import BARRIER, negotiate


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the set has called it (ranks that have
    joined count as arrived, as in Horovod).

    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: not initialised, or this rank is not in the set.
    :raises HorovodInternalError: the ranks called different ops at this point.

    Example::

        hvd.barrier()
    """
    ps = member(process_set, "barrier")
    negotiate(ps, (BARRIER, None, (), ()))
    dist.barrier(group=ps._data)
