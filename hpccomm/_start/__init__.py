"""Start-up: how a process joins the job and its groups are made.

- :mod:`~hpccomm._start.bootstrap`: MPI started and the launch checked on
  every rank together, rank discovery (local rank, node), the key-value store
  made over MPI, the ``mpi://`` rendezvous;
- :mod:`~hpccomm._start.creator`: the backend creator torch calls for every
  hpccomm group (the world and subgroups, their communicators and adapters),
  and the world made again after a shrink (hpccomm.fault_tolerance).

The public calls (``hpccomm.init_process_group`` ...) are :mod:`hpccomm.init`'s.
"""
