"""An op's declaration: everything hpccomm states about one op, in one object.

Each op family's module (:mod:`~hpccomm._ops.reduce`, :mod:`~hpccomm._ops.gather`,
:mod:`~hpccomm._ops.scatter`, :mod:`~hpccomm._ops.alltoall`, :mod:`~hpccomm._ops.p2p`)
tells its ops' whole story: the functions below, then one :class:`Op` per op
naming them.  Nothing else in hpccomm states a fact of one op: the op path
(hpccomm._ops.op_path), the adapters torch calls, the cross-rank checks, the
messages and the GPU routes all read the declaration.

An op's call goes through five functions, each defined once (``args``: the
op's arguments, torch's tensors with its options' ReduceOp and root, passed
as one tuple to the functions on the fast path and unpacked by ``check``):

``key(args)``
    the call's shape: what its checks' verdict and its plan's structure depend
    on (the op, dtypes, element counts, ReduceOp, root, peer), hashable,
    without its memory or layout in it (the plan reads those every call);
    None where the call is not cached.  Only the hot ops have one: a repeated call of the same shape
    skips ``check`` (hpccomm._ops.op_path keeps the :class:`Call` per group).
    tests/test_declarations.py holds every key to its check: a change of any
    field that changes the verdict or the signature changes the key.
``check(group, *args)``
    every argument checked, on any device, before anything is allocated or
    sent; a refusal raises :class:`hpccomm.errors.OpError`.  Returns the
    :class:`Call`: the call's :class:`Signature` and the facts its plan
    needs (a reduction, counts, the root's side).
``plan(group, call, args)``
    the plan of the checked call on these tensors (hpccomm._core.plan): MPI
    buffers on their memory, the steps around the MPI call.  The CPU path,
    CUDA-aware MPI and staging run it (the GPU transports on their view of
    the group, or on host stand-ins).
``bind(group, call)`` (the hot ops only)
    the plan of the call's shape bound at its first call, when the op path
    keeps the :class:`Call`: a function ``fill(args)`` that makes the plan of
    a later call of that shape from its tensors' addresses alone (the MPI
    calls, counts, datatypes and ReduceOp fixed once), with no steps around
    its MPI call; None where the shape needs ``plan`` (past the count limit,
    AVG, ...).  ``fill`` returns None for tensors it does not take (strided,
    aliased): ``plan`` makes theirs.  Whatever it returns is what ``plan``
    returns for the same call (tests/test_declarations.py holds the two
    together); every form runs it, and a blocking call on a quiet group runs
    it on the fast path (hpccomm._ops.op_path.run).
``composed(group, call, args)`` (reductions only)
    the plan of hpccomm's own reduction composed of point-to-point messages
    (hpccomm._ops.composed), for a CUDA-aware MPI that reduces device memory
    slowly.

The rest is data: the torch methods the op serves (the adapters' methods of
those names run it), how NCCL takes the call
(torch's NCCL process group; CuPy's), the roles of its tensors, whether it
is point-to-point, reduces, has a nonblocking form, can be cut into chunks.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Callable, Optional

import torch

_codes = itertools.count(1)


class Signature:
    """What must agree across a group's ranks for one call of an op.

    ``op``: the op's name; ``tensors``: ``(dtype, count)`` of each tensor
    whose size must be equal on every rank (``count`` a tuple for a list whose
    sizes every rank must pass alike, as all_gather's output list); ``fields``:
    ``(label, value)`` of the other arguments that must agree (``("op",
    "SUM")``, ``("root", 0)``); ``pairs``: what this rank sends to and expects
    from each peer, ``(sends, receives)`` in elements, where those may differ
    across ranks but must fit together (all_to_all: what rank i sends to j is
    what j expects from i), else None.  ``key`` is the hashable part that is
    equal on every rank of a correct program (without ``pairs``).

    Example::

        Signature("all_reduce", ((torch.float32, 4),), (("op", "SUM"),)).describe()
        # 'all_reduce(float32[4], SUM)'
    """

    __slots__ = ("op", "tensors", "fields", "pairs", "key")

    def __init__(self, op: str, tensors: tuple = (), fields: tuple = (), pairs=None) -> None:
        self.op, self.tensors, self.fields, self.pairs = op, tensors, fields, pairs
        self.key = (op, tensors, fields)

    def describe(self) -> str:
        """The call in messages: ``all_reduce(float32[4], SUM)``, ``broadcast(int64[8], root 1)``,
        ``all_gather([float32[2], float32[3]])`` (a list with one tensor per rank)."""
        parts = [_tensor(d, n) for d, n in self.tensors]
        parts += [str(v) if label == "op" else f"{label} {v}" for label, v in self.fields]
        return f"{self.op}({', '.join(parts)})"

    def digest(self) -> int:
        """A 64-bit hash of :attr:`key`, the same in every process (Python's
        ``hash`` of a string is salted per process): what the every-call check
        exchanges (hpccomm._core.signatures)."""
        text = repr((self.op, tuple((dtype_name(d), n) for d, n in self.tensors), self.fields))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")

    def __eq__(self, other) -> bool:
        return isinstance(other, Signature) and (self.key, self.pairs) == (other.key, other.pairs)

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Signature({self.describe()}{'' if self.pairs is None else f', pairs={self.pairs}'})"

    def __reduce__(self):
        return Signature, (self.op, self.tensors, self.fields, self.pairs)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tensor(dtype, n) -> str:
    """``float32[4]``; a list of counts: ``[float32[2], float32[3]]``."""
    if isinstance(n, tuple):
        return f"[{', '.join(_tensor(dtype, k) for k in n)}]"
    return f"{dtype_name(dtype)}[{n}]"


class Call:
    """A checked call of an op (what ``check`` returns, hpccomm._ops.op_path
    caches by the call's key): its :class:`Signature` and ``facts``, what its
    plan needs that the checks worked out (the op's own: a
    hpccomm._ops.checks.Reduction, counts, the root's side, ...);
    ``cacheable``: its facts hold for every call of its shape (not so for a
    PREMUL_SUM, whose factor is the call's own: checked every time);
    ``agreed``: its group's ranks agreed on its signature
    (hpccomm._core.signatures: the first-call check), so a cached call skips
    that lookup; ``fingerprint``: what the every-call check sends and expects
    back for it (made once: a cached call's is reused); ``io``: its tensors'
    counts and dtypes as the flight recorder keeps them
    (hpccomm._core.flight.tensors_io: made when the op path keeps the call,
    or at an uncached call's first run; the key of a cached call fixes them); ``fill``: its op's
    ``bind`` of it, once the op path keeps it (None: ``plan`` makes each
    plan)."""

    __slots__ = ("signature", "facts", "cacheable", "agreed", "fingerprint", "io", "fill")

    def __init__(self, signature: Signature, facts=None, cacheable: bool = True) -> None:
        self.signature, self.facts, self.cacheable, self.agreed = signature, facts, cacheable, False
        self.fingerprint = None  # (hpccomm._core.signatures: made at the call's first check, kept with it)
        self.io = None  # (hpccomm._core.flight: made when kept, or at its first run)
        self.fill = None  # (hpccomm._ops.op_path.remember: its op's bind of it)


def uncached(args) -> None:
    """The key of an op without one: every call is checked."""
    return None


class Op:
    """One op's declaration (see the module docstring).

    :param name: the op's name in messages, keys and ``hpccomm.explain``.
    :param methods: torch's method names it serves (``("allreduce",)``): the
        adapters' methods of those names run it (hpccomm._adapters.methods.TorchOps;
        tests/test_declarations.py holds the two together).
    :param legacy: torch's older names for the same methods, which only the
        ProcessGroup adapter (torch 2.13's route) answers.
    :param check, plan, key, bind, composed: the op's functions (module docstring).
    :param p2p: point-to-point: a peer waits for this rank, not every member.
    :param reducing: it reduces (its last argument is the ReduceOp).
    :param first: its first argument's role: ``"out"`` (written), ``"inout"``
        (read and written) or ``"in"`` (read); the others are read.
    :param roles: ``roles(args, rank) -> first`` where the role depends on the
        rank (reduce writes at its root only; broadcast's root only reads).
    :param nonblocking: it has a nonblocking MPI form, posted for
        ``async_op=True`` calls (point-to-point ops always are).
    :param chunkable: its result on a chunk of its one tensor is its result
        on that chunk (a staged transport pipelines it).
    :param slot: which argument may hold this rank's part of the other in
        place (``"output"``: all_gather_into_tensor's input in its slot of the
        output; ``"input"``: reduce_scatter_tensor's output in its slot of the
        input): NCCL's in-place forms.
    :param any_source: None may name its peer (a receive from any rank).
    :param receives: a receive (a peer sends to it: the flight record draws
        it ``<-``).
    :param matched_by: a point-to-point op's counterpart, the op its peer must
        post for it to complete (send's ``"recv"``, recv's ``"send"``): the
        watchdog's diagnosis of a timed-out one names it.
    :param completes: a posted op's step once its request completed, given
        ``(plan, status, peer, describe, error)``: its request's MPI status is
        kept for it (hpccomm._core.record); ``error`` None: it checks what
        arrived and returns the source rank (the Work's ``source_rank``),
        raising where it does not fit; ``error`` the request's MPI error: it
        returns the error to raise instead, or None (recv's: a receive's count
        and truncation checks, hpccomm._ops.p2p.received).
    :param nccl: ``nccl(backend, args, opts)``: the call made on torch's NCCL
        process group with NCCL's arguments (hpccomm._gpu.nccl_wire rewrote them).
    :param cupy: ``cupy(transport, group, args)``: the call made through
        CuPy's NCCL bindings (hpccomm._gpu.nccl_cupy), None where CuPy has no form.
    :param recorded_as: its name in torch's flight records where that is not
        ``name`` (``_all_gather_base``): torch's analyser matches ops by it
        (hpccomm._core.flight).
    :param scatters: a reduce_scatter: each rank receives one block of the
        reduction; a CUDA-aware MPI may run these far slower than its all_reduce
        (hpccomm._gpu.select: the route of CUDA ones may differ from the other
        reductions').
    :param stacked: ``(inputs, outputs)``: whether torch records that list of
        per-rank tensors as one tensor stacked along a new first dimension
        (all_gather's outputs): the analyser compares those sizes with the
        group's size.
    """

    __slots__ = ("name", "methods", "legacy", "check", "plan", "key", "composed", "p2p", "reducing", "first",
                 "roles", "nonblocking", "chunkable", "slot", "any_source", "receives", "matched_by", "completes",
                 "nccl", "cupy", "recorded_as", "stacked", "scatters", "bind", "code")

    def __init__(self, name: str, *, methods: tuple, check: Callable, plan: Callable, key: Optional[Callable] = None,
                 bind: Optional[Callable] = None, composed: Optional[Callable] = None, legacy: tuple = (),
                 p2p: bool = False, reducing: bool = False,
                 first: str = "out", roles: Optional[Callable] = None, nonblocking: bool = False,
                 chunkable: bool = False, slot: Optional[str] = None, any_source: bool = False,
                 receives: bool = False, matched_by: Optional[str] = None, completes: Optional[Callable] = None,
                 nccl: Optional[Callable] = None,
                 cupy: Optional[Callable] = None,
                 recorded_as: Optional[str] = None, stacked: tuple = (False, False), scatters: bool = False) -> None:
        self.name, self.methods, self.legacy = name, tuple(methods), tuple(legacy)
        self.check, self.plan, self.composed = check, plan, composed
        self.key = key if key is not None else uncached
        self.bind = bind
        self.p2p, self.reducing, self.first, self.roles = p2p, reducing, first, roles
        self.nonblocking, self.chunkable, self.slot, self.any_source = nonblocking, chunkable, slot, any_source
        self.receives, self.matched_by, self.completes = receives, matched_by, completes
        self.nccl, self.cupy = nccl, cupy
        self.recorded_as, self.stacked, self.scatters = recorded_as or name, stacked, scatters
        self.code = next(_codes)  # (unique: what distinguishes two ops' cache keys)

    def role(self, args, rank: int) -> str:
        """The first argument's role in this call on group rank ``rank``: ``"in"``, ``"out"`` or ``"inout"``."""
        return self.first if self.roles is None else self.roles(args, rank)

    def __repr__(self) -> str:
        return f"<op {self.name}>"


#: torch's tensor class (a subclass takes the uncached path: its methods may differ).
Tensor = torch.Tensor
STRIDED = torch.strided
