"""CUDA tensors: the GPU transports, chosen per group and device.

One module per strategy: :mod:`~hpccomm._gpu.cuda_mpi` (device memory handed
to a CUDA-aware MPI), :mod:`~hpccomm._gpu.nccl_torch` (torch's NCCL process
group on hpccomm's store), :mod:`~hpccomm._gpu.nccl_cupy` (CuPy's NCCL, unique
id over MPI), :mod:`~hpccomm._gpu.staged` (reused pinned host buffers and the
CPU path).  :mod:`~hpccomm._gpu.probe` asks the libraries what they can do,
:mod:`~hpccomm._gpu.select` decides, :mod:`~hpccomm._gpu.dispatch` routes the
op path's CUDA calls.  Nothing here runs at import: probes run at the first
CUDA op or for ``hpccomm info`` (:func:`hpccomm.gpu.info`).  See docs/gpu.md.
"""
