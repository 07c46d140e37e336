"""Every op hpccomm runs: the declarations of the op family modules, in one list.

The adapters build torch's methods from it (hpccomm._adapters.methods), and
:func:`hpccomm.explain` finds an op by its name here.
"""
from __future__ import annotations

from . import alltoall, gather, p2p, reduce, scatter

#: Every op's declaration (hpccomm._ops.op.Op), family by family.
OPS = (*reduce.OPS, *gather.OPS, *scatter.OPS, *alltoall.OPS, *p2p.OPS)

#: Ops by name (all_reduce is the dense op's: the sparse one, torch's ``allreduce_sparse``, shares its name).
BY_NAME = {op.name: op for op in reversed(OPS)}
