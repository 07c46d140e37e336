"""Op translation: torch semantics into plans (MPI buffers, counts, roots).

One module per op family (:mod:`~hpccomm._ops.reduce`,
:mod:`~hpccomm._ops.gather`, :mod:`~hpccomm._ops.scatter`,
:mod:`~hpccomm._ops.alltoall`, :mod:`~hpccomm._ops.p2p`), each op one plan
function (:mod:`~hpccomm._ops.plan`) that checks every argument before any
communication (:mod:`~hpccomm._ops.checks`) and hands contiguous CPU tensors
to MPI zero-copy (:mod:`~hpccomm._ops.staging` makes the copies the torch API
forces).  :mod:`~hpccomm._ops.table` lists every op and its properties.
"""
