"""The mismatch checks: a collective that the ranks of a group call
differently (another op, size, dtype, ReduceOp or root, splits that do not
fit) raises on every rank, naming each rank's call, before any data moves.

The most common mistake in distributed code is a collective that the ranks
call differently: left to MPI, depending on the library and the group's
size, it returns wrong data without a word (another ReduceOp or root, on
every library), fails on some ranks while others hang or return wrong data
(another count), or hangs or aborts inside the library (a rank in another
collective, or one that skipped a step's: no rank gets past it, so only a
check before the op can name it; docs/benchmarks.md, "Why no lagged mode,
on any MPI").  What must agree is each op's declared signature
(hpccomm._ops.op.Signature: the op, every tensor's dtype and element count,
the ReduceOp, the root; all_to_all's splits as pairs that must fit).
``HPCCOMM_MISMATCH_CHECK`` says how it is compared:

``every`` (the default)
    every collective call, in every form (blocking, queued on the comm
    thread, posted), is compared before it runs (:func:`compare`): the ranks
    sum a fixed-size fingerprint of their signatures in one small allreduce
    on the group's ``checks`` communicator (a duplicate that only checks use,
    so a check never matches an op), and each compares the sum with what it
    would be had every rank called what it called.  The fingerprint
    (:func:`fingerprint`) is three 20-bit hashes of the signature, each with
    its square, and a sum of hashes of what this rank sends each peer minus
    what it expects from each: the sums equal ``size`` times this rank's own
    hashes and squares only where every rank's hashes are equal (a sum of
    squared differences is zero only then), and the pairs' sum is zero only
    where every send meets an equal receive.  A mismatch (or a rank whose
    own checks refused the call, :func:`refuse`) takes every rank to one
    allgather of the calls' descriptions and the same error everywhere
    (:func:`_differ`).  Fixed size: the cost grows with the group as an
    allreduce of 56 bytes does (log P), never with the descriptions; a
    cached checked call keeps its fingerprint (docs/benchmarks.md: the cost).
``first``
    the first call of each signature on a group is compared (:func:`first_call`):
    the ranks allgather what each is about to do and either raise together
    or agree and remember the signature; later calls of an agreed signature
    run at once.  Not compared: a later call whose signature each rank had
    agreed on before but which differ now, and the nonblocking forms (posted
    or queued: whether one is posted depends on each rank's queue).  A rank
    in a check while another runs an agreed op is found by the watchdog
    (:func:`watch`), which names it on both and ends the job.
``off``
    no comparison: what MPI gives.

``HPCCOMM_DEBUG=DETAIL`` compares every call's whole description instead
(hpccomm._core.debug_mode), one allgather per op.

Why no mode makes ranks disagree on which collectives run: in ``every``
mode every collective call is compared, in every form, in the thread that
runs it and in the group's op order (a posted call is posted only with
nothing queued before it); in ``first`` mode the set of agreed signatures is
the same on every rank (a signature joins it when the gathered keys are equal
everywhere) and the signature holds only what is equal on every rank of a
correct program, so a rank that skips the check while another runs it means
the ranks really did call that op differently.

Threads: a check runs in the thread that runs the op (the group's collectives
run one at a time, in issue order), on the group's ``checks`` communicator,
which only that thread uses; the watchdog's part never calls MPI but for
MPI_Abort.
"""
from __future__ import annotations

import collections
import logging
import struct
import time

from .. import _mpi, config
from ..errors import HpccommError
from . import debug_mode, failures, flight

log = logging.getLogger("hpccomm")

#: ``HPCCOMM_MISMATCH_CHECK``'s values (see the module docstring).
EVERY, FIRST, OFF = "every", "first", "off"
#: What an MPI error in a check is said to come from.
LABEL = " (signature check)"
#: Signatures remembered per group by the first-call check; past this many the group stops checking (the
#: count is equal on every rank, so every rank stops at the same call), said once.
MAX_SIGNATURES = 1024
_WAIT = 3.0  # seconds the rank that found the mismatch waits for the checking rank's own line

HINT = ("The ranks of a group must call the same collectives in the same order with matching sizes, dtypes, "
        "ReduceOps and roots")
#: The watchdog's lines (:func:`watch`) name one rank's call only (an agreed call is not sent again): debug mode
#: names each.
DETAIL = "HPCCOMM_DEBUG=DETAIL compares every call across ranks and names each rank's call"

_M64 = (1 << 64) - 1
_BITS = 20  # bits of each of the fingerprint's three hashes (a sum of P squares fits 64 bits up to 2^22 ranks)
_MASK = (1 << _BITS) - 1
_REFUSED = (1 << _BITS) + 1  # the hashes of a refused call: none of a real call's
_PACK = struct.Struct("<7Q")  # the fingerprint: three hashes, each with its square, and the pairs' sum


def mode() -> str:
    """``HPCCOMM_MISMATCH_CHECK`` (read at init: hpccomm.config)."""
    return config.get("HPCCOMM_MISMATCH_CHECK")


class Checks:
    """A group's checks (its one attribute ``checks``): ``comm``, a duplicate
    of the group's communicator that only the cross-rank checks use (this
    module's and debug mode's); ``every``: every call is compared
    (:func:`compare`), with ``box`` the bytes its sums land in and ``spec``
    that as an MPI buffer; ``agreed``, the keys of the signatures agreed on by
    the first-call check (hpccomm._ops.op.Signature.key; None: it is off);
    ``done``, the op numbers this rank compared (the watchdog's test of a
    stuck check); ``count``, the signatures agreed on; ``note_seq``, the
    op number of the check the watchdog left a note of (0: none); ``current``,
    ``(op number, the call described)`` while this rank compares a call
    (None otherwise; the op runs under its own name meanwhile, so that a
    timeout names the op as it always did).  One attribute of the group."""

    __slots__ = ("comm", "every", "box", "spec", "agreed", "done", "count", "note_seq", "current")

    def __init__(self, comm, how: str) -> None:
        self.comm, self.every = comm, how == EVERY
        self.box = bytearray(_PACK.size)
        self.spec = [self.box, _PACK.size // 8, _mpi.mpi().UINT64_T] if self.every else None
        self.agreed = set() if how == FIRST else None
        self.done, self.count, self.note_seq, self.current = set(), 0, 0, None


def attach(group) -> None:
    """Give a new group (every member, at creation) its :class:`Checks` (the
    members dup the communicator together, here, so that no check ever runs
    on ``comm``)."""
    group.checks = Checks(group.comm.Dup(), mode())


def detach(group) -> None:
    """Free the checks' communicator (Group.free)."""
    checks = getattr(group, "checks", None)
    if checks is not None and checks.comm is not None:
        comm, checks.comm = checks.comm, None
        comm.Free()


# ----------------------------------------------------------------------------
# every call: a fixed-size fingerprint, summed across the group
# ----------------------------------------------------------------------------

def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit hash of ``x`` (the same in every process)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _pairs_term(rank: int, pairs) -> int:
    """This rank's part of the pairs' sum: the hashes of what it sends each
    peer minus those of what it expects from each, as ``(from, to, count)``;
    summed over the group it is zero where every send meets an equal receive."""
    if pairs is None:
        return 0
    sends, receives = pairs
    total = 0
    for peer, n in enumerate(sends):
        total += _mix(_mix((rank << 32) | peer) ^ n)
    for peer, n in enumerate(receives):
        total -= _mix(_mix((peer << 32) | rank) ^ n)
    return total & _M64


def _pack(hashes, size: int, term: int = 0):
    """``(sent, expected)``: the fingerprint of ``hashes`` and its sum over a
    group of ``size`` ranks that all sent the same hashes."""
    vector, sums = [], []
    for h in hashes:
        vector += [h, h * h]
        sums += [size * h, size * h * h]
    return _PACK.pack(*vector, term), _PACK.pack(*sums, 0)


def fingerprint(group, call):
    """``(sent, expected)`` bytes of checked ``call`` on ``group`` (see the
    module docstring), made once per call (a cached call keeps it)."""
    made = call.fingerprint
    if made is None:
        digest = call.signature.digest()
        hashes = (digest & _MASK, (digest >> _BITS) & _MASK, (digest >> 2 * _BITS) & _MASK)
        made = _pack(hashes, group.size, _pairs_term(group.rank, call.signature.pairs))
        if call.signature.pairs is None:
            call.fingerprint = made  # (pairs are this call's own: made again every call)
    return made


def compare(group, call, seq: int) -> None:
    """Collective ``seq`` of ``group`` (checked ``call``), before it runs:
    every rank sums its fingerprint with the others' (one allreduce of 56
    bytes on the group's ``checks`` communicator); a sum that is not what an
    agreement gives raises on every rank (:func:`_differ`).

    :raises HpccommError: the ranks called op ``seq`` differently (nothing was sent).
    :raises mpi4py.MPI.Exception: the exchange itself failed (the op path names the op).
    """
    made = call.fingerprint or fingerprint(group, call)
    checks = group.checks
    box = checks.box
    box[:] = made[0]
    checks.comm.Allreduce(_mpi.IN_PLACE, checks.spec, _mpi.SUM)
    if box != made[1]:
        _differ(group, call.signature, seq)


def refuse(group, op: str, seq: int, refusal) -> None:
    """This rank's own checks refused collective ``seq`` (``refusal``, an
    OpError, of op ``op``) while the other ranks may call it and wait: it
    joins their comparison with a fingerprint no call has, so every rank
    learns of it at once and raises (this rank its own refusal).

    :raises OpError: ``refusal``, on this rank.
    """
    sent, _ = _pack((_REFUSED,) * 3, group.size)
    checks = group.checks
    checks.box[:] = sent
    checks.comm.Allreduce(_mpi.IN_PLACE, checks.spec, _mpi.SUM)
    _differ(group, None, seq, refusal, op)


def _differ(group, signature, seq: int, refusal=None, op: str = "") -> None:
    """The ranks' sums say the calls differ (or this rank refused its own):
    every rank sends its call's description, and raises the same error,
    naming each rank's call and what does not fit; a refusal is raised as
    the refusing rank's message.  ``signature`` None: this rank refused."""
    if signature is None:
        mine = (seq, f"{op}(refused here)", None, None, (type(refusal).__name__, str(refusal)))
    else:
        mine = (seq, signature.describe(), signature.key, signature.pairs, None)
        op = signature.op
    everyone = group.checks.comm.allgather(mine)
    refusals = [(r, e[4]) for r, e in enumerate(everyone) if e[4] is not None]
    if refusal is not None:
        raise refusal
    if refusals:
        r, (kind, text) = refusals[0]
        who = group.global_ranks[r]
        raise HpccommError(f"hpccomm {op} ({group.where(seq)}): rank {who} refused this call ({kind}: {text}). "
                           f"Nothing was sent. Fix the call on rank {who}: its message says what is wrong")
    problem = _compare(group, [e[:4] for e in everyone])
    if problem:
        flight.dump_quietly(f"the ranks called op #{seq} on group '{group.name}' differently")
        raise HpccommError(f"hpccomm {op} ({group.where(seq)}): the ranks called this collective differently: "
                           f"{problem}. Nothing was sent. {HINT}")


# ----------------------------------------------------------------------------
# the first call of each signature
# ----------------------------------------------------------------------------

def compared(group, call) -> bool:
    """Whether checked ``call`` (hpccomm._ops.op.Call) on ``group`` would be
    compared across ranks before it runs (every call is, by default; in
    ``first`` mode a signature new to the group; debug mode compares every
    call): :func:`hpccomm.explain` says it."""
    if group.debug or group.checks.every:
        return True
    agreed = group.checks.agreed
    return agreed is not None and call.signature.key not in agreed


def first_call(group, call, seq: int) -> None:
    """The first call of a signature on ``group`` (``call``: the checked call,
    hpccomm._ops.op.Call), op number ``seq``: compare it across the group's
    ranks before it runs (its key, equal on every rank of a correct program,
    and its pairs, which must fit together: all_to_all's splits); on
    agreement remember it (and mark ``call`` agreed), else raise
    :class:`HpccommError` on every rank, naming every rank's call.

    :raises HpccommError: the ranks called op ``seq`` differently (nothing
        was sent; the group stays usable: every rank raised).
    :raises mpi4py.MPI.Exception: the exchange itself failed (the op path
        names the op).
    """
    checks, signature = group.checks, call.signature
    agreed = checks.agreed
    key = signature.key
    if key in agreed:  # (another call of the same signature: agreed on before)
        call.agreed = True
        return
    common = signature.describe()
    checks.done.add(seq)
    checks.current = (seq, common)
    try:
        everyone = checks.comm.allgather((seq, common, key, signature.pairs))
    finally:
        checks.current = None
        if checks.note_seq == seq:  # the watchdog left a note of this check, which is over
            _unnote(group)
    problem = _compare(group, everyone)
    if problem:
        flight.dump_quietly(f"the ranks called op #{seq} on group '{group.name}' differently")
        raise HpccommError(f"hpccomm {signature.op} ({group.where(seq)}): the ranks called this collective "
                           f"differently: {problem}. Nothing was sent. {HINT}")
    agreed.add(key)
    call.agreed = True
    checks.count += 1
    if checks.count >= MAX_SIGNATURES:
        checks.agreed = None
        log.warning("hpccomm: group '%s' has agreed on %d collective signatures: it compares no more "
                    "first calls (HPCCOMM_DEBUG=DETAIL compares every call)", group.name, checks.count)


def _compare(group, everyone) -> str:
    """What differs among the ranks' ``(seq, call described, key, pairs)``
    (empty: nothing): every rank's call, where the keys differ or the pairs
    do not fit, and which sizes do not fit."""
    g = group.global_ranks
    fit = debug_mode.sizes_fit(group, [pairs for *_, pairs in everyone])
    if not fit and len({(s, key) for s, _, key, _ in everyone}) == 1:
        return ""
    by_call: dict = {}
    for r, (s, what, _, _) in enumerate(everyone):
        by_call.setdefault((s, what), []).append(g[r])
    named = "; ".join(f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs))} called {what} (op #{s})"
                      for (s, what), rs in by_call.items())
    return f"{named}: {fit}" if fit else named


# ----------------------------------------------------------------------------
# the watchdog's part: one rank in a check, another in the op
# ----------------------------------------------------------------------------

def _note_key(g) -> str:
    return f"hpccomm/checking/{g.key}"


def _verdict_key(g, seq: int) -> str:
    return f"hpccomm/mismatch/{g.key}/{seq}"


def watch(op, notes_left: set) -> bool:
    """The watchdog's part for ``op`` (a :class:`state.Op` running for a
    second or more): a check leaves a note (once: ``notes_left`` holds the
    checks it left one of) and looks for another rank's verdict; an op looks
    for a note of a check it did not take part in.  On a mismatch the job
    ends as the failure policy says (hpccomm._core.failures.mismatch); True
    once reported."""
    g = op.group
    checks = getattr(g, "checks", None)
    if op.kind != "collective" or g.store is None or g.size == 1 or checks is None:
        return False
    if checks.agreed is None and not checks.done:  # the check is off for this group
        return False
    store = g.store
    current = checks.current
    if current is not None and current[0] == op.seq:  # this rank compares the call
        call = current[1]
        if (id(g), op.seq) not in notes_left:
            notes_left.add((id(g), op.seq))
            store.set(_note_key(g), f"{g.rank}\t{op.seq}\t{call}")
            checks.note_seq = op.seq
            if checks.current is not current:
                _unnote(g)  # the check ended meanwhile (and may not have seen checks.note_seq): no stale note
                return False
        key = _verdict_key(g, op.seq)
        if not store.check([key]):
            return False
        said = store.get(key).decode(errors="replace")
        me = g.global_ranks[g.rank]
        failures.mismatch(f"hpccomm: rank {me}: {call} ({op.where()}) cannot run: the ranks called this "
                          f"collective differently: {said}. {HINT}. {DETAIL}; aborting the job",
                          f"called op #{op.seq} on group '{g.name}' differently from other ranks",
                          lambda: store.set(key + "/seen", "1"))  # (the other rank waits for it)
        return True
    key = _note_key(g)
    if not store.check([key]):
        return False
    rank, seq, what = store.get(key).decode(errors="replace").split("\t", 2)
    seq = int(seq)
    if seq > op.seq or seq in checks.done:  # not there yet, or a check this rank took part in
        return False
    me, other = g.global_ranks[g.rank], g.global_ranks[int(rank)]
    mine = op.name if seq == op.seq else f"op #{seq}, then {op.name} (op #{op.seq})"
    said = (f"rank {other} called {what} (op #{seq}), a call new to this group, while rank {me} called {mine} "
            "with a signature the group had agreed on before")
    verdict = _verdict_key(g, seq)

    def tell():
        store.set(verdict, said)
        deadline = time.monotonic() + _WAIT  # the checking rank prints its own line first
        while time.monotonic() < deadline and not store.check([verdict + "/seen"]):
            time.sleep(0.1)

    failures.mismatch(f"hpccomm: rank {me}: {op.name} ({op.where()}) cannot complete: the ranks called op #{seq} "
                      f"differently: {said}. {HINT}. {DETAIL}; aborting the job",
                      f"called op #{seq} on group '{g.name}' differently from other ranks", tell)
    return True


def _unnote(g) -> None:
    """Delete the note of this rank's check (it is over): a note left behind
    would read, later, as a check that other ranks never joined."""
    try:
        g.store.delete_key(_note_key(g))
    except Exception:  # noqa: BLE001 - the store may be gone as the job ends
        pass
