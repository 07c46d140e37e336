"""Horovod's PyTorch API on hpccomm: ``import hpccomm.horovod as hvd``.

Scripts written for ``horovod.torch`` run on a current torch by changing the
import line; the collectives run over hpccomm's MPI process groups
(torch.distributed underneath, so Horovod calls mix with ``dist.*`` calls).
See docs/horovod.md for what is supported and how it differs::

    import hpccomm.horovod as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

``hvd.elastic`` is not supported: importing it raises ImportError.
"""
from __future__ import annotations

from .basics import (HorovodInternalError, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, rocm_built, size, start_timeline, stop_timeline)
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .lifecycle import init, shutdown
from .ops.allgather import (allgather, allgather_async, grouped_allgather, grouped_allgather_async,
                            sparse_allreduce_async)
from .ops.allreduce import (allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce,
                            grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_)
from .ops.alltoall import alltoall, alltoall_async
from .ops.barrier import barrier
from .ops.broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from .ops.checks import Adasum, Average, Max, Min, Product, Sum
from .ops.handles import poll, synchronize
from .ops.join import join
from .ops.reducescatter import (grouped_reducescatter, grouped_reducescatter_async, reducescatter,
                                reducescatter_async)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "Product",
    "ProcessSet", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]


def __getattr__(name):
    if name == "elastic":  # hvd.elastic: the submodule's ImportError says why it is not supported
        import importlib

        importlib.import_module(__name__ + ".elastic")  # raises
    raise AttributeError(f"module 'hpccomm.horovod' has no attribute {name!r}")
