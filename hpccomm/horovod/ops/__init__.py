"""Horovod's collectives (``hvd.allreduce`` and the rest) over hpccomm's process groups.

One module per op family, over the machinery they share; imports point down
this list only (``tests/test_horovod.py::test_horovod_imports_point_one_way`` checks it):

- :mod:`.checks`: Horovod's reduction ops and dtypes, the argument checks
  every op makes on the calling rank, and the words its errors start with;
- :mod:`.handles`: what an op leaves behind until :func:`synchronize`: its
  handle, its started data step, and the names it holds (Horovod's rule: no
  two ops in flight with one name on a process set);
- :mod:`.negotiation`: the agreement step before every op's data moves;
- :mod:`.allreduce`, :mod:`.allgather` (and the sparse allreduce made of two
  allgathers), :mod:`.broadcast`, :mod:`.alltoall`, :mod:`.reducescatter`,
  :mod:`.barrier`: the ops;
- :mod:`.join`: ``hvd.join``, above :mod:`hpccomm.horovod.optimizer` too,
  since a joined rank feeds zeros into DistributedOptimizer's reductions.

Every op has two steps:

1. **Agreement.** The ranks of the process set allgather three integers on the
   set's control group: a state (0 ready, -1 "my input was refused", k > 0
   "I have joined"), a hash of the op's description (kind, name, dtypes,
   shapes, ReduceOp, scale factors, root) and one size (allgather's first
   dimension).  When the hashes agree and nobody joined, the op goes on.
   Otherwise the ranks allgather their full descriptions and every rank raises
   the same error naming the ranks and what differs, so a mismatch is an
   error, never a hang.  Ranks that called :func:`join` take part in this step
   from their join loop and, for allreduce and barrier, feed zeros into the
   data step (Horovod's join).
2. **Data.** The transfer runs as a torch.distributed op on the set's data
   group: in the calling thread for the blocking functions (``allreduce``,
   ``broadcast_``, ...), with ``async_op=True`` (on hpccomm's comm thread) for
   the ``*_async`` functions, which return an integer handle for
   :func:`poll`/:func:`synchronize`.

Horovod matches ops across ranks by name; here they are matched by their
position in each rank's sequence of ops on the process set (as MPI does).
A name still matters on the calling rank: an op whose name another op on the
same process set holds (started, not yet synchronized) raises ``ValueError``
there before anything is sent (see :mod:`.handles`).

This package's ``__init__`` re-exports nothing: ``hpccomm.horovod`` does, so
that ``hvd.allreduce`` is the function while ``hpccomm.horovod.ops.allreduce``
stays the module.
"""
