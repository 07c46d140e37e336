"""The first-call check: the first call of each collective signature on a
group is compared across its ranks, and a mismatch raises on every rank.

The most common mistake in distributed code is a collective that the ranks
call with different sizes (or dtypes, ReduceOps, roots).  Left to MPI it
raises ``MPI_ERR_TRUNCATE`` on some ranks while others return wrong data, and
a broadcast returns wrong data everywhere without a word.  So, on by default
(``HPCCOMM_MISMATCH_CHECK=first``):

- a rank remembers, per group, the signatures ``(op, bytes)`` its ranks have
  agreed on (:class:`Checks`, ``group.checks``); a call whose signature is
  among them runs at once: the op path pays a dict subscript and a set
  lookup (:func:`hpccomm._core.execute.execute`);
- any other call is first compared (:func:`check`): the ranks allgather what
  each is about to do, on the group's ``checks`` communicator (a duplicate
  that only checks use, so a check never matches an op), and either raise
  together, before any data moves, naming every rank's call, or agree and
  remember the signature.  A training loop pays on its first step only.

Why it never makes ranks disagree on which collectives run: the set is the
same on every rank (a signature joins it when the gathered keys are equal
everywhere, a decision made from the same gathered data on every rank), and
the key is chosen so that in a correct program every rank computes the same
one (``(op, bytes of this rank's input)`` where a correct call has equal
inputs everywhere; the whole list of sizes for ``all_gather``, whose inputs
may differ; none for ``all_to_all``, whose splits may differ: it is never
checked by default).  So if one rank skips the check and another runs it,
their calls differ: the ranks really did call op #k differently.  The skipping
rank is then in the op on the group's communicator and the checking one in
the check on its own: neither can go on.  The watchdog resolves it within a
few seconds (:func:`watch`): a check that has waited a second leaves a note
in the group's store (deleted when the check ends); a rank whose op has waited a second and that finds a
note of a check of an op it did not check prints that the ranks called that
op differently, waits for the checking rank to say so too, and ends the job.
A rank whose op completed without the others (a broadcast root) and that
then ends its program is caught by the timeout instead.

What is not caught by default: a later call with a signature already agreed
on (same op and byte count) but another dtype, ReduceOp or root,
``all_to_all``'s splits, and the async collectives that take their
nonblocking MPI form (``HPCCOMM_ASYNC_NONBLOCKING=1``): posted, the check
would block the caller until every rank arrives, and whether such a call is
posted or queued depends on each rank's own queue, so the queued one is not
checked either; ``HPCCOMM_DEBUG=DETAIL`` compares every call
(hpccomm._core.debug_mode).  Cost: docs/troubleshooting.md.

Threads: a check runs in the thread that runs the op (the group's collectives
run one at a time, in issue order), on the group's ``checks`` communicator,
which only that thread uses; the watchdog's part never calls MPI but for
MPI_Abort.
"""
from __future__ import annotations

import collections
import logging
import sys
import time

from .. import _mpi, config
from ..errors import HpccommError
from . import debug_mode, flight, state

log = logging.getLogger("hpccomm")

#: What an MPI error in a check is said to come from.
LABEL = " (first-call signature check)"
#: Signatures remembered per group; past this many the group stops checking (the
#: count is equal on every rank, so every rank stops at the same call), said once.
MAX_SIGNATURES = 1024
#: Ops whose inputs may differ across ranks in a correct program with nothing
#: equal on every rank to key them by: never checked by default.
UNKEYED = frozenset(("all_to_all", "all_to_all_single"))
#: Ops whose inputs may differ across ranks, keyed by every rank's size (the
#: output list, equal on every rank in a correct program).
LISTED = frozenset(("all_gather",))
_WAIT = 3.0  # seconds the rank that found the mismatch waits for the checking rank's own line

HINT = ("The ranks of a group must call the same collectives in the same order with matching sizes, dtypes, "
        "ReduceOps and roots. HPCCOMM_DEBUG=DETAIL compares every call across ranks (not only the first of "
        "each signature) and names both sides")


def enabled() -> bool:
    return config.get("HPCCOMM_MISMATCH_CHECK") == "first"


class Checks:
    """A group's checks (its one attribute ``checks``): ``comm``, a duplicate
    of the group's communicator that only the cross-rank checks use (this
    module's and debug mode's); ``agreed``, the signatures agreed on: op name
    -> the set of byte counts agreed on for it (None: the first-call check is
    off), looked up as ``nbytes in agreed[op]`` on every call (a subscript
    and an int in a set: no tuple is made); ``listed``, all_gather's keys
    (every rank's size); ``done``, the op numbers this rank compared (the
    watchdog's test of a stuck check); ``count``, the signatures agreed on;
    ``noted``, the op number of the check the watchdog left a note of (0:
    none); ``current``, ``(op number, the call described)`` while this rank
    compares a call (None otherwise; the op runs under its own name
    meanwhile, so that a timeout names the op as it always did).
    One attribute of the group, not several: past 30 attributes CPython 3.11
    stops sharing an instance's dict keys, and every attribute read of the
    group on the op path gets slower (measured: 150 to 500 instructions per op)."""

    __slots__ = ("comm", "agreed", "listed", "done", "count", "noted", "current")

    def __init__(self, comm, on: bool) -> None:
        self.comm, self.agreed, self.listed = comm, collections.defaultdict(set) if on else None, set()
        self.done, self.count, self.noted, self.current = set(), 0, 0, None


def attach(group) -> None:
    """Give a new group (every member, at creation) its :class:`Checks` (the
    members dup the communicator together, here, so that no check ever runs
    on ``comm``)."""
    group.checks = Checks(group.comm.Dup(), enabled())


def detach(group) -> None:
    """Free the checks' communicator (Group.free)."""
    checks = getattr(group, "checks", None)
    if checks is not None and checks.comm is not None:
        comm, checks.comm = checks.comm, None
        comm.Free()


def _key(op: str, nbytes: int, args):
    """The key a rank remembers for this call (see the module docstring);
    None: never checked by default."""
    if op in UNKEYED:
        return None
    if op in LISTED:
        try:
            return (op, tuple(t.numel() for t in args[0][0]))
        except (IndexError, TypeError, AttributeError):
            return (op, nbytes)
    return (op, nbytes)


def compared(group, op: str, nbytes: int, args) -> bool:
    """Whether a call of ``op`` (``nbytes`` of this rank's input, ``args``)
    on ``group`` would be compared across ranks before it runs (debug mode,
    or its signature is new to the group): :func:`hpccomm.explain` says it."""
    if group.debug:
        return True
    agreed = group.checks.agreed
    checks = group.checks
    if agreed is None or nbytes in agreed[op]:
        return False
    key = _key(op, nbytes, args)
    return key is not None and key not in checks.listed


def check(group, op: str, nbytes: int, args, seq: int) -> None:
    """The first call of a signature (``op``, ``nbytes`` of this rank's
    input) on ``group``, op number ``seq``: compare it across the group's
    ranks before it runs; on agreement remember it, else raise
    :class:`HpccommError` on every rank, naming every rank's call.

    :raises HpccommError: the ranks called op ``seq`` differently (nothing
        was sent; the group stays usable: every rank raised).
    :raises mpi4py.MPI.Exception: the exchange itself failed (the op path
        names the op).
    """
    checks = group.checks
    agreed = checks.agreed
    key = _key(op, nbytes, args)
    if key is None or key in checks.listed:  # an unkeyed op, or a listed op seen before
        return
    common, mine = debug_mode.describe(op, args, group.size)
    checks.done.add(seq)
    checks.current = (seq, common)
    try:
        everyone = checks.comm.allgather((seq, common, mine, key))
    finally:
        checks.current = None
        if checks.noted == seq:  # the watchdog left a note of this check, which is over
            _unnote(group)
    problem = _compare(group, everyone)
    if problem:
        flight.dump_quietly(f"the ranks called op #{seq} on group '{group.name}' differently")
        raise HpccommError(f"hpccomm {op} ({group.where(seq)}): the ranks called this collective differently: "
                           f"{problem}. Nothing was sent. {HINT}")
    if all(e[3] == key for e in everyone):
        if op in LISTED:
            checks.listed.add(key)
        else:
            agreed[op].add(nbytes)
        checks.count += 1
        if checks.count >= MAX_SIGNATURES:
            checks.agreed = None
            log.warning("hpccomm: group '%s' has agreed on %d collective signatures: it compares no more "
                        "first calls (HPCCOMM_DEBUG=DETAIL compares every call)", group.name, checks.count)


def _compare(group, everyone) -> str:
    """What differs among the ranks' ``(seq, call, size facts, key)`` (empty: nothing)."""
    g = group.global_ranks
    calls = [(s, what) for s, what, _, _ in everyone]
    if len(set(calls)) > 1:
        by_call: dict = {}
        for r, (s, what) in enumerate(calls):
            by_call.setdefault((s, what), []).append(g[r])
        return "; ".join(f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs))} called {what} "
                         f"(op #{s})" for (s, what), rs in by_call.items())
    fit = debug_mode.sizes_fit(group, [e[2] for e in everyone])
    return f"{calls[0][1]}: {fit}" if fit else ""


# ----------------------------------------------------------------------------
# the watchdog's part: one rank in a check, another in the op
# ----------------------------------------------------------------------------

def _note_key(g) -> str:
    return f"hpccomm/checking/{g.key}"


def _verdict_key(g, seq: int) -> str:
    return f"hpccomm/mismatch/{g.key}/{seq}"


def watch(op, noted: set) -> bool:
    """The watchdog's part for ``op`` (a :class:`state.Op` running for a
    second or more): a check leaves a note (once, in ``noted``) and looks
    for another rank's verdict; an op looks for a note of a check it did not
    take part in.  Prints and ends the job on a mismatch; True once reported."""
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
        if (id(g), op.seq) not in noted:
            noted.add((id(g), op.seq))
            store.set(_note_key(g), f"{g.rank}\t{op.seq}\t{call}")
            checks.noted = op.seq
            if checks.current is not current:
                _unnote(g)  # the check ended meanwhile (and may not have seen checks.noted): no stale note
                return False
        key = _verdict_key(g, op.seq)
        if not store.check([key]):
            return False
        said = store.get(key).decode(errors="replace")
        me = g.global_ranks[g.rank]
        _say(f"hpccomm: rank {me}: {call} ({op.where()}) cannot run: the ranks called this "
             f"collective differently: {said}. {HINT}; aborting the job")
        store.set(key + "/seen", "1")
        _end(f"called op #{op.seq} on group '{g.name}' differently from other ranks")
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
    _say(f"hpccomm: rank {me}: {op.name} ({op.where()}) cannot complete: the ranks called op #{seq} "
         f"differently: {said}. {HINT}; aborting the job")
    verdict = _verdict_key(g, seq)
    store.set(verdict, said)
    deadline = time.monotonic() + _WAIT  # the checking rank prints its own line first
    while time.monotonic() < deadline and not store.check([verdict + "/seen"]):
        time.sleep(0.1)
    _end(f"called op #{seq} on group '{g.name}' differently from other ranks")
    return True


def _unnote(g) -> None:
    """Delete the note of this rank's check (it is over): a note left behind
    would read, later, as a check that other ranks never joined."""
    try:
        g.store.delete_key(_note_key(g))
    except Exception:  # noqa: BLE001 - the store may be gone as the job ends
        pass


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _end(what: str) -> None:
    state.record_failure(what)
    _mpi.abort(6)


def mpi_failed(what: str, exc) -> HpccommError:
    """A collective's MPI call failed (``what``: the op and its place):
    outside fault tolerance the likely cause is a mismatch that the
    first-call check could not see (a signature agreed on before), and the
    other ranks may have returned wrong data from the op, so the job ends
    here, the cause said.  With ``HPCCOMM_ABORT_ON_EXCEPTION=0`` (or one
    rank in the world) the error is returned for the caller to raise."""
    try:
        truncated = exc.Get_error_class() == _mpi.mpi().ERR_TRUNCATE  # a receive larger than its buffer
    except Exception:  # noqa: BLE001 - not an MPI exception
        truncated = False
    text = (f"hpccomm {what}: MPI failed: {exc}. {'Likely' if truncated else 'A possible'} cause: the ranks "
            "called this collective with different sizes, dtypes, ReduceOps or roots, or called different "
            "collectives; HPCCOMM_DEBUG=DETAIL compares every call across ranks and names both sides")
    if state.world.size > 1 and config.get("HPCCOMM_ABORT_ON_EXCEPTION"):
        _say(f"hpccomm: rank {state.world.rank}: {text[len('hpccomm '):]}. Other ranks may have returned wrong "
             "data from this op: aborting the job")
        _end(f"failed in {what} (MPI: {exc})")
    return HpccommError(text)
