"""What torch calls: the two adapters torch sees and the op methods they share.

- :mod:`~hpccomm._adapters.methods`: torch's method names (``allreduce``, ``all_gather_single``, ...)
  mapped onto the op path (hpccomm._ops.op_path), one method per name an op declares;
- :mod:`~hpccomm._adapters.process_group`: ``ProcessGroupHpccomm``, a ``ProcessGroup`` subclass
  (torch 2.13);
- :mod:`~hpccomm._adapters.backend`: ``BackendHpccomm``, a c10d ``Backend`` subclass (torch >= 2.14).

The public names are ``hpccomm.ProcessGroupHpccomm`` and ``hpccomm.BackendHpccomm``.  How torch
finds hpccomm in the first place (entry points, the rendezvous) is :mod:`hpccomm._torch`, above
start-up; these sit below it, under the op path's callers.
"""
