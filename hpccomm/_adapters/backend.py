"""The torch >= 2.14 adapter: a c10d ``Backend`` whose ops run on MPI.

torch 2.14 added a pybind trampoline (``PyBackend``) through which a Python
subclass of ``torch._C._distributed_c10d.Backend`` is dispatched like a C++
backend: torch builds its own ``ProcessGroup`` around it, so per-device
backend strings (``"cpu:hpccomm,cuda:nccl"``), ``batch_isend_irecv``'s
coalescing, ``dist.split_group`` and ``dist.monitored_barrier`` reach hpccomm
through torch's own machinery.  The op methods are shared with the
ProcessGroup adapter (:mod:`hpccomm._adapters.methods`); this class adds what a
Backend answers: its options, what it supports, coalescing windows,
splitting, its timeout and lifetime.

Where it is used (``hpccomm._start.creator.make_adapter``): as the group itself for a
per-device backend string, or with ``HPCCOMM_ADAPTER=backend``; otherwise
registered inside hpccomm's ProcessGroup adapter for every device, so that
torch's per-device lookups (``group._get_backend(device)``) find hpccomm.

What torch 2.14/2.15's trampoline does not carry when this Backend is the
group (docs/design.md, "Torch versions"): ``dist.gather_single`` (its C++
method has no Python override; gloo refuses it too), and of the Work torch
hands back to Python only ``wait()`` and ``get_future()`` reach hpccomm's
Work: ``is_completed()`` stays False and ``_source_rank()`` raises, so
``dist.recv`` from any source fails after receiving.  The ProcessGroup
adapter has neither gap.
"""
from __future__ import annotations

from datetime import timedelta

from .. import _mpi
from .._about import BACKEND_NAME
from .._compat import BackendBase, BackendOptions
from .._core import comm_thread, state
from .._core import group as _group
from .._core.watchdog import watchdog
from .._ops import op_path
from ..barrier import monitored_barrier
from . import methods

__all__ = ["BACKEND_NAME", "BackendHpccomm"]


class BackendHpccomm(methods.TorchOps, BackendBase):
    """hpccomm as a c10d Backend over one MPI communicator (torch >= 2.14).

    Made by the backend creator torch calls (``dist.init_process_group``,
    ``dist.new_group``, :func:`hpccomm.from_mpi4py`) and by :meth:`split`;
    not usually constructed directly.  torch wraps it in a
    ``torch.distributed.ProcessGroup``; :func:`hpccomm.mpi_comm` gives a
    group's communicator.  Which adapter serves a group is chosen at init
    (``HPCCOMM_ADAPTER``): this one whenever the backend string sends another
    device type elsewhere, the :class:`ProcessGroupHpccomm` adapter otherwise
    (it is faster per op; docs/benchmarks.md).

    :param group: hpccomm's internal description of the group (communicators,
        ranks, timeout).
    :param options: the ``Backend.Options`` torch passed (made if None).

    Example::

        dist.init_process_group("cpu:hpccomm,cuda:nccl")   # CPU tensors on this Backend
        pg = dist.group.WORLD
        be = pg._get_backend(torch.device("cpu"))          # a BackendHpccomm
        hpccomm.mpi_comm(pg).Get_size()                    # the group's communicator
    """

    def __init__(self, group, options=None) -> None:
        super().__init__(group.rank, group.size)
        self._g = group
        if options is None:
            options = BackendOptions(BACKEND_NAME, timeout=group.timeout or timedelta(minutes=30))
            options.global_ranks_in_group = list(group.global_ranks)
        self._options = options

    # -- what torch asks of a Backend -----------------------------------------
    @property
    def options(self):
        return self._options

    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def supports_coalescing(self) -> bool:
        return True

    @property
    def supports_shrinking(self) -> bool:
        """``dist.shrink_group`` works in fault-tolerance mode (HPCCOMM_FAULT_TOLERANCE=ulfm)."""
        return state.failures.tolerant

    def _get_sequence_number_for_group(self) -> int:
        return self._g.seq

    def set_timeout(self, timeout) -> None:
        self._g.timeout = timeout
        self._options._timeout = timeout

    # -- coalescing (batch_isend_irecv) ---------------------------------------
    def start_coalescing(self) -> None:
        op_path.start_coalescing(self._g)

    def end_coalescing(self):
        return op_path.end_coalescing(self._g)

    # -- barriers ---------------------------------------------------------------
    def monitored_barrier(self, opts, wait_all_ranks: bool = False) -> None:
        """``dist.monitored_barrier`` (see :func:`hpccomm.monitored_barrier`)."""
        timeout = getattr(opts, "timeout", None)
        if timeout is not None and timeout.total_seconds() <= 0:
            timeout = None
        monitored_barrier(self._g, timeout=timeout, wait_all_ranks=wait_all_ranks)

    # -- groups -----------------------------------------------------------------
    def split(self, store, ranks, opts):
        """The backend of ``ranks`` (ranks of this group) for ``dist.split_group``;
        collective over this group (MPI_Comm_split): None on non-members."""
        g, ranks = self._g, [int(r) for r in ranks]
        MPI = _mpi.mpi()
        member = g.rank in ranks
        comm_thread.flush(g)  # the comm thread must be off this communicator
        token = watchdog.begin(g, "split_group", g.seq)
        try:
            comm = g.comm.Split(min(ranks) if member else MPI.UNDEFINED, ranks.index(g.rank) if member else 0)
        finally:
            watchdog.end(token)
        if not member:
            return None
        timeout = getattr(opts, "_timeout", None) or g.timeout
        child = _group.Group(comm, [g.global_ranks[r] for r in ranks], store=store, timeout=timeout)
        if opts is None:
            opts = BackendOptions(BACKEND_NAME, timeout=timeout)
        opts.global_ranks_in_group = list(child.global_ranks)
        return BackendHpccomm(child, opts)

    #: Recovery after a lost rank (hpccomm.fault_tolerance.backend_shrink, set by that module, which
    #: sits above the adapters: it rebuilds groups through hpccomm's start-up).
    shrinker = None

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
        """The backend over this group's survivors, for ``dist.shrink_group``
        after a rank failure (fault-tolerance mode; ``ranks_to_exclude``, group
        ranks, must be the failed ones): see :func:`hpccomm.fault_tolerance.backend_shrink`."""
        return self.shrinker(self, ranks_to_exclude, opts_override)

    # (abort, shutdown: hpccomm._adapters.methods.TorchOps)


methods.hide_methods(BackendHpccomm)
