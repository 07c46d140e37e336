"""Op translation and the op path: torch semantics into plans (MPI buffers,
counts, roots), and every call run in its form.

One module per op family (:mod:`~hpccomm._ops.reduce`,
:mod:`~hpccomm._ops.gather`, :mod:`~hpccomm._ops.scatter`,
:mod:`~hpccomm._ops.alltoall`, :mod:`~hpccomm._ops.p2p`), each op one plan
function (:mod:`~hpccomm._core.plan`) that checks every argument before any
communication (:mod:`~hpccomm._ops.checks`) and hands contiguous CPU tensors
to MPI zero-copy (:mod:`~hpccomm._ops.staging` makes the copies the torch API
forces).  :mod:`~hpccomm._ops.table` lists every op and its properties;
:mod:`~hpccomm._ops.op_path` runs a call: its plan (or a GPU transport's,
hpccomm._gpu, below), in the form decided once.
"""
