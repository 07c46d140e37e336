"""CUDA tensors: the GPU transports, chosen per group and device.

One module per strategy: :mod:`~hpccomm._gpu.cuda_mpi` (device memory handed
to a CUDA-aware MPI), :mod:`~hpccomm._gpu.nccl_torch` (torch's NCCL process
group on hpccomm's store), :mod:`~hpccomm._gpu.nccl_cupy` (CuPy's NCCL, unique
id over MPI), :mod:`~hpccomm._gpu.staged` (reused pinned host buffers and the
CPU path).  Around them, one job each: :mod:`~hpccomm._gpu.probe` asks the
libraries what they can do and :mod:`~hpccomm._gpu.findings` keeps this
process's answers; :mod:`~hpccomm._gpu.select` decides from every member's
facts and :mod:`~hpccomm._gpu.agreement` gathers them; a group's routes,
settings and transports live on the group (:mod:`~hpccomm._gpu.group_routes`,
:mod:`~hpccomm._gpu.overrides`, :mod:`~hpccomm._gpu.transports`);
:mod:`~hpccomm._gpu.detect` finds a call's device and tensors, :mod:`~hpccomm._gpu.dispatch`
its route, :mod:`~hpccomm._gpu.delegation` the Work of what NCCL takes;
:mod:`~hpccomm._gpu.binding` binds ranks to GPUs.  Nothing here runs at
import: probes run at the first CUDA op or for ``hpccomm info``
(:func:`hpccomm.gpu.info`).  See docs/gpu.md.
"""
