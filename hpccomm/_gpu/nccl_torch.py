"""Transport: torch's own NCCL process group, built on hpccomm's store.

Each hpccomm group that sends CUDA tensors gets one ``ProcessGroupNCCL`` over
the same ranks, made from the group's key-value store (the TCPStore hpccomm
opened and announced over MPI, or the one torch's rendezvous made), under
the prefix ``hpccomm-nccl/``: still no MASTER_ADDR.  A torch subgroup maps to
its own NCCL communicator, because each hpccomm subgroup has its own store
and ranks.  The op is handed to NCCL with torch's own option objects and
NCCL's Work is returned as is: NCCL's stream semantics (``wait()`` makes the
current stream wait) are torch's, unchanged.
"""
from __future__ import annotations

import logging

import torch

from .. import _compat as compat
from .._compat import RedOpType
from ..errors import OpValueError
from .nccl_wire import Ability

log = logging.getLogger("hpccomm")


def _redop(op):
    return op if isinstance(op, compat.ReduceOp) else compat.ReduceOp(op)


class Options:
    """What an op's NCCL form (hpccomm._ops.op.Op ``nccl``) builds torch's call
    with: ``options(kind, given, **fields)`` is a fresh torch option object of
    ``kind`` with ``fields`` (a ReduceOp made one where a kind was passed),
    keeping the caller's timeout and asyncOp when it gave options;
    :meth:`coalesced` calls a coalesced method or, without one, the single
    method per pair."""

    def __call__(self, kind: str, given, **fields):
        opts = compat.OPTION_CLASSES[kind]()
        for name, value in fields.items():
            setattr(opts, name, _redop(value) if name == "reduceOp" else value)
        if given is not None:
            for name in ("timeout", "asyncOp"):
                if hasattr(given, name) and hasattr(opts, name):
                    try:
                        setattr(opts, name, getattr(given, name))
                    except (TypeError, AttributeError):  # a ReduceOp passed where options belong
                        pass
        return opts

    @staticmethod
    def coalesced(backend, name: str, single: str, outputs, inputs, opts):
        """``backend.<name>`` if it has one, else one call per pair: NCCL runs a
        communicator's ops in order on one stream, so the last Work completes
        after all of them."""
        method = getattr(backend, name, None)
        if method is not None:
            return method(outputs, inputs, opts)
        work = None
        for o, i in zip(outputs, inputs):
            work = getattr(backend, single)(o, i, opts)
        return work


OPTIONS = Options()


#: What torch's NCCL process group takes (its dtype map and ReduceOps, torch 2.13-2.15:
#: ProcessGroupNCCL.cpp's getNcclDataType / getNcclReduceOp); hpccomm._gpu.nccl_wire rewrites the rest.
ABILITY = Ability(
    dtypes=frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32,
                      torch.float64, torch.bfloat16, torch.bool}),
    redops=frozenset({RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.AVG,
                      RedOpType.PREMUL_SUM}),
    avg=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    # (not bfloat16: torch's group hands NCCL a host factor as a 4-byte float where NCCL reads 2 bytes, so a
    # power of two reads as zero, and refuses a bfloat16 device factor: pytorch#190745, seen on an H200 with
    # torch 2.11; hpccomm scales a copy and sums instead, on every torch)
    premul=frozenset({torch.float16, torch.float32, torch.float64}),
)


class TorchNCCL:
    """Delegates CUDA ops to a ``ProcessGroupNCCL`` over the group's store."""

    name = "nccl"
    delegates = True  # takes the whole op, after hpccomm's checks, rewritten (hpccomm._gpu.nccl_wire)
    ability = ABILITY

    def __init__(self, device, reason: str, make_backend=None) -> None:
        self.device = device
        self.reason = reason
        self._make = make_backend if make_backend is not None else compat.make_nccl_backend
        self.backend = None

    def _backend(self, group):
        if self.backend is None:
            if group.store is None:
                raise OpValueError("nccl", group.where(), "this group has no key-value store to build NCCL on")
            store = compat.PrefixStore("hpccomm-nccl/", group.store)
            self.backend = self._make(store, group.rank, group.size, group.timeout, f"hpccomm-nccl:{group.name}",
                                      group.global_ranks)
            log.info("hpccomm: group '%s': NCCL process group made on hpccomm's store (%d ranks)",
                     group.name, group.size)
        return self.backend

    def delegate(self, group, op, args, opts):
        """NCCL's Work for ``op`` (a declaration, hpccomm._ops.op.Op) called
        with ``args`` as NCCL takes them (hpccomm._gpu.nccl_wire.rewrite): the
        op's NCCL form."""
        if op.nccl is None:
            raise OpValueError(op.name, group.where(), f"{op.name} has no NCCL form in hpccomm")
        return op.nccl(self._backend(group), args, opts, OPTIONS)

    def plan(self, op, group, call, args):
        raise AssertionError("TorchNCCL delegates: it runs no hpccomm plan")

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None and hasattr(backend, "shutdown"):
            backend.shutdown()
