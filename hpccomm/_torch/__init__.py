"""The torch-facing side: what torch calls, and every version-sensitive torch symbol.

- :mod:`~hpccomm._torch.compat`: every torch symbol whose place or form differs
  between the supported torch versions;
- :mod:`~hpccomm._torch.methods`: torch's op methods (``allreduce``,
  ``all_gather_single`` ...) mapped onto the op path, shared by the two adapters
  (:mod:`hpccomm.process_group`, :mod:`hpccomm.backend`);
- :mod:`~hpccomm._torch.plugin`: how torch finds hpccomm (entry points, the
  ``mpi://`` rendezvous).

Importing this package imports nothing of torch.
"""

#: The backend name registered with torch:
#: ``dist.init_process_group(hpccomm.BACKEND_NAME)`` is ``dist.init_process_group("hpccomm")``.
BACKEND_NAME = "hpccomm"
