"""Op translation: torch semantics into flat MPI buffers, counts and roots.

One module per op family.  Each op takes a :class:`hpccomm._group.Group` and
plain tensors, validates everything before any communication (raising
:class:`hpccomm.errors.OpError` with the user's tensors unchanged), then
calls MPI.  Contiguous CPU tensors are handed to MPI zero-copy.
"""
