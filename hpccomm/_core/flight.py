"""The flight recorder: each group's last ops on this rank, written in the format torch's analyser reads.

Every group keeps its last ``HPCCOMM_FR_BUFFER_SIZE`` ops (default 2000; 0 turns the recorder off)
in ``group.flight``, a ring (a ``collections.deque`` with a maximum length, made by :func:`ring`).
hpccomm._core.state.start, which numbers every op, puts the op in its group's ring when the op path
hands it the op's ``io`` (:func:`tensors_io`): per input and per output tensor, its element
count and dtype, and what the op's declaration says of its record (its name in torch's records,
which lists torch stacks, whether it receives).  An entry is a tuple of plain values (the fields
hpccomm._core.state.F_ID ...), never a tensor.  The op path makes a call's ``io`` once and keeps
it with the checked call (hpccomm._ops.op.Call.io): every later call of a cached shape hands over
the same tuple.

A record (:func:`write`) is one pickle per rank, in the file torch's own backends write their
flight record to: the prefix in ``TORCH_FR_DUMP_TEMP_FILE`` (or its older name
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``), else torch's default
``$XDG_CACHE_HOME/torch/comm_lib_trace_rank_`` (``XDG_CACHE_HOME`` unset: ``$HOME/.cache``,
``HOME`` unset: ``/tmp/.cache``), followed by the world rank (:func:`prefix`).  It holds what
torch's ``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX`` reads (its
``components/loader.py``, ``builder.py`` and ``types.py``, torch 2.13 to 2.15): ``version``
``"2.10"``, ``pg_config`` (each group's name, description and world ranks), ``pg_status`` and
``entries`` (one dict per op, torch's keys), plus ``hpccomm`` (why it was written, the rank, host
and pid; fr_trace ignores it).  fr_trace takes only the op names of torch's own backends
(``nccl:``, ``gloo:`` ...), so hpccomm names its ops as torch's CPU backend does:
``gloo:all_reduce``, ``gloo:send 0->1``; ``comm_lib_version`` says hpccomm, over which MPI
library.  Whether an op is over is asked of hpccomm._core.state as the record is written: one it
lists as running is ``started``, any other ``completed``.

When a record is written: on request (:func:`write`, public as ``hpccomm.dump_flight_record()``);
and, quietly and within a bound (:func:`dump_quietly`: a dump never raises into the job's error
path, never holds it up more than a few seconds), when an op times out (hpccomm._core.watchdog),
the ranks call a collective differently and every rank raises (hpccomm._core.signatures, debug
mode), a rank fails (the first RankFailure, hpccomm._core.failures; the SIGTERM a launcher sends
when one died, hpccomm._core.signals), and before hpccomm ends the job with MPI_Abort
(:func:`before_abort`, on ``hpccomm._mpi.at_abort``: an uncaught exception, a timeout, a mismatch
seen by the watchdog).  A rank ending the job asks the others, through the world's key-value
store, to write theirs too, and waits for them a few seconds at most (:func:`answer`: each one's
watchdog looks while an op of its has waited a second or more): under MPICH and Intel MPI the
launcher ends the others with SIGKILL, which leaves them no chance afterwards.

Threads: entries are appended in the thread that numbers the op (a ring's ``append`` is atomic);
a record is written in the thread that asks for it (the watchdog, the signal thread, an
excepthook, the caller), copying each ring at once (``list(deque)`` runs without releasing the
GIL), inside a thread of its own (``hpccomm-flight``) when it must be bounded.  Nothing here calls
MPI.

Example::

    hpccomm.dump_flight_record()   # -> '/home/me/.cache/torch/comm_lib_trace_rank_0'
"""
from __future__ import annotations

import collections
import logging
import os
import pickle
import socket
import threading
import time
from typing import Optional

import torch

from .. import _mpi, config
from ..errors import HpccommError
from . import state

log = logging.getLogger("hpccomm")

#: The dump format's version: what torch 2.13-2.15's recorders write (fr_trace checks that every rank's agrees).
VERSION = "2.10"
#: The backend name in each op's ``profiling_name``: fr_trace accepts only torch's own
#: (nccl, gloo, ...), and gloo is torch's CPU backend (see the module docstring).
BACKEND = "gloo"
#: The prefix torch's recorders write to when ``TORCH_FR_DUMP_TEMP_FILE`` is unset (under the cache folder).
DEFAULT_NAME = "comm_lib_trace_rank_"
#: The fields of an entry, by index (hpccomm._core.state.F_ID ...; its io: :func:`make_io`).
ID, KIND, SEQ, OTHER_SEQ, NAME, PEER, IO, START = (state.F_ID, state.F_KIND, state.F_SEQ, state.F_OTHER_SEQ,
                                                   state.F_NAME, state.F_PEER, state.F_IO, state.F_START)

_Tensor = torch.Tensor
_BOUND = 5.0  # seconds a dump on a failure may take, whatever the file system or the store do
_WAIT = 2.0  # seconds a rank ending the job waits for the others' records (where it must: before_abort)
_REQUEST = "hpccomm/flight/request"  # world store: a rank ending the job asks the others for theirs
_WRITTEN = "hpccomm/flight/written"  # world store: how many ranks wrote theirs since


class _Once:
    counted = False  # this rank counted its record in the world store (_WRITTEN)
    hooked = False  # before_abort is on hpccomm._mpi.at_abort


_once = _Once()


def ring():
    """A new group's ring: its last ``HPCCOMM_FR_BUFFER_SIZE`` ops (None: the recorder is off).
    Called once per group, at its creation (hpccomm._core.group)."""
    size = config.get("HPCCOMM_FR_BUFFER_SIZE")
    if not size:
        return None
    if not _once.hooked:
        _once.hooked = True
        _mpi.at_abort.append(before_abort)
    return collections.deque(maxlen=size)


def tensors_io(op, args) -> tuple:
    """The ``io`` of a call of ``op`` (hpccomm._core.state.start records it) with torch's ``args``
    (the adapter's, after the group): each tensor's element count and dtype, in and out, and what
    the op's declaration (hpccomm._ops.op.Op) says of its record: its name in torch's records
    (``recorded_as``), which lists torch records stacked (``stacked``), and whether it is a receive.
    ``op.first`` is its first argument's role (``"out"``, written, its inputs then in the second
    argument; ``"inout"``, read and written; ``"in"``, read).  No tensor is kept.  (A plain
    tensor, alone or alone in a list, is read without a loop: the common case, on every op.)

    Example::

        tensors_io(ALL_REDUCE, ([torch.ones(4)], ReduceOp.SUM))
        # ('all_reduce', False, False, False, 1, 1, 4, torch.float32, 4, torch.float32)
    """
    first = op.first
    x = args[0] if args else None
    if x.__class__ is list and len(x) == 1:
        x = x[0]
    if x.__class__ is _Tensor:
        sizes, dtypes = (x.numel(),), (x.dtype,)
    else:
        sizes, dtypes = _counts(x)
    if first == "inout":
        return make_io(op, sizes, dtypes, sizes, dtypes)
    if first == "in":
        return make_io(op, sizes, dtypes, (), ())
    y = args[1] if len(args) > 1 else None
    if y.__class__ is list and len(y) == 1:
        y = y[0]
    if y.__class__ is _Tensor:
        return make_io(op, (y.numel(),), (y.dtype,), sizes, dtypes)
    if y.__class__ is int or y is None:  # a receive's source
        return make_io(op, (), (), sizes, dtypes)
    sizes_in, dtypes_in = _counts(y)
    return make_io(op, sizes_in, dtypes_in, sizes, dtypes)


def make_io(op, sizes_in, dtypes_in, sizes_out, dtypes_out) -> tuple:
    """An ``io``: one flat tuple ``(title, stacked in, stacked out, receives, inputs, outputs,
    *counts in, *dtypes in, *counts out, *dtypes out)`` (``op``: its declaration's
    ``recorded_as``, ``stacked``, ``receives``; :func:`parts` reads it back).  Flat, of plain
    values: an entry holding it holds nothing Python's garbage collector tracks, so the collector
    stops tracking each entry at once (nested tuples, or a declaration's tuple made at import,
    kept the entries tracked, and rings of them made full collections run)."""
    stack_in, stack_out = op.stacked
    return (op.recorded_as, stack_in, stack_out, op.receives, len(sizes_in), len(sizes_out),
            *sizes_in, *dtypes_in, *sizes_out, *dtypes_out)


def parts(io) -> tuple:
    """``(title, stacked in, stacked out, receives, counts in, dtypes in, counts out, dtypes out)``
    of an ``io`` (:func:`make_io`)."""
    n_in, n_out = io[4], io[5]
    a = 6 + n_in
    b = a + n_in
    c = b + n_out
    return (*io[:4], io[6:a], io[a:b], io[b:c], io[c:c + n_out])


def _counts(tensors) -> tuple:
    """``(counts, dtypes)`` of a tensor, or of the tensors in a list (of lists); anything else: none."""
    counts, dtypes = [], []
    stack = [tensors]
    while stack:
        x = stack.pop()
        if isinstance(x, _Tensor):
            counts.append(x.numel())
            dtypes.append(x.dtype)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
    return tuple(counts), tuple(dtypes)


# ----------------------------------------------------------------------------
# the dump
# ----------------------------------------------------------------------------

def prefix() -> str:
    """Where dumps go, as torch's own recorders decide it (see the module docstring): files are
    ``prefix() + str(rank)``."""
    chosen = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if chosen:
        return chosen
    cache = os.environ.get("XDG_CACHE_HOME") or (os.environ.get("HOME") or "/tmp") + "/.cache"
    return os.path.join(cache, "torch", DEFAULT_NAME)


def write(reason: str = "on request") -> str:
    """Write this rank's flight record (every live group's last ops) to ``prefix() + rank``,
    replacing any earlier one; returns the file's path.  ``reason``: why, kept in the record.

    :raises HpccommError: the recorder is off (``HPCCOMM_FR_BUFFER_SIZE=0``), or no group was made.
    :raises OSError: the file could not be written.
    """
    rings = [g for g in _groups() if g.flight is not None]
    if not rings:
        raise HpccommError("hpccomm dump_flight_record: nothing to write: "
                           + ("the flight recorder is off (HPCCOMM_FR_BUFFER_SIZE=0)"
                              if not config.get("HPCCOMM_FR_BUFFER_SIZE") else "no hpccomm process group exists"))
    record = snapshot(rings, reason)
    path = prefix() + str(state.world.rank)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    # Written beside it under a name of this thread's that fr_trace skips (it reads every file
    # holding the prefix), then renamed: a reader never sees half a record, a dump cut short leaves
    # the last one whole, and two threads writing at once (the watchdog's and a signal's) need no
    # lock that a hung file system could leave held: the later rename wins.
    part = os.path.join(folder, f".hpccomm-flight-{os.getpid()}-{threading.get_ident()}.part")
    try:
        with open(part, "wb") as f:
            pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.unlink(part)
    log.info("hpccomm: rank %d wrote its flight record (%s) to %s", state.world.rank, reason, path)
    return path


#: The entries of completed ops already written, per group (``id(group)``): ``{record id: (the ring's
#: tuple, entry)}``.  A completed op's entry never changes, so a later record reuses it: a job that
#: keeps running after a mismatch it caught writes each record in a fraction of the time.  An entry
#: is reused only for the very tuple it was made from (``is``: a group made where a freed one was
#: gets that one's ``id``, and its record ids are not this cache's to trust).  Only a group's place
#: in the record, ``pg_id``, is in an entry and not in the op: an entry of a group that moved (the
#: live groups are a set, whose order changes as groups come and go) is a copy with the new place.
#: Each group keeps only the entries of its ring's ops: at most the recorder's size per live group.
_written: dict = {}
_written_lock = threading.RLock()  # (re-entered if a signal handler writes a record in a thread building one)


def snapshot(groups, reason: str = "on request") -> dict:
    """The record of ``groups`` (hpccomm groups with a ring), as :func:`write` pickles it."""
    entries, pg_config, pg_status = [], {}, {}
    running = _running()
    wall = time.time() - time.monotonic()  # (entries hold monotonic times; torch's are wall-clock ns)
    with _written_lock:  # (two threads may write at once: the watchdog's and a signal's)
        kept = {}
        for pg_id, g in enumerate(groups):
            now = {}
            _group_entries(g, pg_id, running, wall, _written.get(id(g), {}), now, entries, pg_config, pg_status)
            kept[id(g)] = now
        _written.clear()
        _written.update(kept)
    entries.sort(key=lambda d: d["record_id"])
    from .._about import __version__

    return {"version": VERSION, "comm_lib_version": f"hpccomm {__version__} over {_library()}",
            "pg_config": pg_config, "pg_status": pg_status, "entries": entries,
            "hpccomm": {"reason": reason, "rank": state.world.rank, "size": state.world.size,
                        "host": socket.gethostname(), "pid": os.getpid(),
                        "buffer_size": config.get("HPCCOMM_FR_BUFFER_SIZE")}}


def _group_entries(g, pg_id: int, running: set, wall: float, known: dict, now: dict, entries: list,
                   pg_config: dict, pg_status: dict) -> None:
    """Group ``g``'s part of a record, number ``pg_id``: its config, status and entries (appended
    to ``entries``); completed entries are taken from ``known`` when there and kept in ``now``."""
    ring = list(g.flight)  # (one C call: no op can append meanwhile)
    ended = {e[ID] for e in ring if (id(g), e[KIND] == "p2p", e[SEQ]) not in running}
    desc = g.desc or "undefined"
    pg_config[g.name] = {"name": g.name, "desc": desc, "ranks": str(list(g.global_ranks))}
    pg_status[str(pg_id)] = {
        "last_enqueued_collective": g.seq,
        "last_started_collective": max((e[SEQ] for e in ring if e[KIND] != "p2p"), default=-1),
        "last_completed_collective": max((e[SEQ] for e in ring if e[KIND] != "p2p" and e[ID] in ended),
                                         default=-1)}
    timeout_ms = int(g.timeout_s * 1000) if g.timeout_s else 0
    for e in ring:
        done = e[ID] in ended
        made = known.get(e[ID]) if done else None
        if made is None or made[0] is not e:
            entry = _entry(e, done, wall, g, pg_id, desc, timeout_ms)
        elif made[1]["pg_id"] != pg_id:
            entry = {**made[1], "pg_id": pg_id}
        else:
            entry = made[1]
        if done:
            now[e[ID]] = (e, entry)
        entries.append(entry)


def _running() -> set:
    """``(id(group), point-to-point, number)`` of every op running on this rank now (hpccomm._core.state's
    records; a group's creation, split or shrink is no op of its ring)."""
    return {(id(r.group), r.kind == "p2p", r.seq) for r in state.records() if r.kind != "setup"}


def _entry(e, done: bool, wall: float, g, pg_id: int, desc: str, timeout_ms: int) -> dict:
    """One entry as torch writes it (keys: torch's ``FlightRecorder`` dump, version 2.10); ``done``:
    the op is over; ``wall``: the wall clock's time at the monotonic clock's 0."""
    p2p = e[KIND] == "p2p"
    title, stack_in, stack_out, receives, counts_in, dtypes_in, counts_out, dtypes_out = parts(e[IO])
    if p2p:
        seq, p2p_seq = e[OTHER_SEQ], e[SEQ]
        peer = -1 if e[PEER] is None else e[PEER]  # -1: a receive from any source
        title = f"{title} {g.rank}<-{peer}" if receives else f"{title} {g.rank}->{peer}"
    else:
        seq, p2p_seq = e[SEQ], e[OTHER_SEQ]
    sizes_in, sizes_out = [_size(s) for s in counts_in], [_size(s) for s in counts_out]
    started = int((e[START] + wall) * 1e9)
    return {
        "record_id": e[ID], "pg_id": pg_id, "process_group": (g.name, desc),
        "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": e[ID], "is_p2p": p2p,
        "profiling_name": f"{BACKEND}:{title}",
        "time_created_ns": started,
        "input_sizes": _stacked(sizes_in) if stack_in else sizes_in,
        "input_dtypes": _dtypes(dtypes_in, stack_in),
        "output_sizes": _stacked(sizes_out) if stack_out else sizes_out,
        "output_dtypes": _dtypes(dtypes_out, stack_out),
        "state": "completed" if done else "started",
        "time_discovered_started_ns": started, "time_discovered_completed_ns": None,
        "retired": done, "timeout_ms": timeout_ms, "frames": [],
    }


def _size(s) -> list:
    return [s] if isinstance(s, int) else [int(d) for d in s]


def _stacked(sizes: list) -> list:
    """Per-rank tensors as torch records them: one tensor ``[ranks, *shape]`` (one ``[elements]``
    when the shapes differ)."""
    if not sizes:
        return sizes
    if all(s == sizes[0] for s in sizes):
        return [[len(sizes), *sizes[0]]]
    total = 0
    for s in sizes:
        n = 1
        for d in s:
            n *= d
        total += n
    return [[total]]


_DTYPE_NAMES: dict = {}


def _dtypes(dtypes, stacked: bool) -> list:
    names = [_dtype_name(d) for d in dtypes]
    return names[:1] if stacked else names


def _dtype_name(dtype) -> str:
    """torch's name of a dtype in its records (c10's ScalarType: ``Float``, ``Int``, ``BFloat16``)."""
    if isinstance(dtype, str):
        return dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        try:  # torch.empty(0, dtype=torch.float32).type() is 'torch.FloatTensor'
            name = torch.empty(0, dtype=dtype).type().rpartition(".")[2].removesuffix("Tensor")
        except Exception:  # noqa: BLE001 - a dtype without a CPU tensor type: its Python name
            name = str(dtype).replace("torch.", "")
        _DTYPE_NAMES[dtype] = name
    return name


def _groups() -> list:
    """Every live hpccomm group of this rank."""
    while True:
        try:
            return list(state.groups)
        except RuntimeError:  # the set changed while being copied (another thread made a group)
            continue


def _library() -> str:
    try:
        return _mpi.library_version()
    except Exception:  # noqa: BLE001 - MPI not started, or finalised
        return "MPI"


# ----------------------------------------------------------------------------
# dumps on a failure: quiet and bounded
# ----------------------------------------------------------------------------

def dump_quietly(reason: str, ending: bool = False, ask: bool = False) -> Optional[str]:
    """Write this rank's record after a failure (``reason``), in a thread of its own, waiting at
    most a few seconds; never raises.  ``ending``: this rank ends the job now: the record is
    counted in the world store, and every rank asked for its own; ``ask``: then wait until every
    rank counted its record (:data:`_WAIT` seconds at most).  Returns the path, or None (the
    recorder is off, nothing to write, or the write failed or did not end in time)."""
    if not config.get("HPCCOMM_FR_BUFFER_SIZE"):
        return None
    done: list = []
    worker = threading.Thread(target=_dump, args=(reason, ending, ask, done), name="hpccomm-flight", daemon=True)
    try:
        worker.start()
        worker.join(_BOUND + (_WAIT if ask else 0.0))
    except Exception:  # noqa: BLE001 - no thread can start (the interpreter is ending)
        return None
    return done[0] if done else None


def _dump(reason: str, ending: bool, ask: bool, done: list) -> None:
    try:
        done.append(write(reason))
    except Exception as exc:  # noqa: BLE001 - a dump must not add an error of its own to the failure
        log.info("hpccomm: rank %d could not write its flight record: %s", state.world.rank, exc)
        done.append(None)
    if not (ending or ask) or state.world.size == 1 or state.world.store is None:
        return
    try:
        _count_and_wait(ask)
    except Exception:  # noqa: BLE001 - the store may be gone with rank 0
        pass


def _count_and_wait(ask: bool) -> None:
    store = state.world.store
    if not store.check([_REQUEST]):  # (ranks whose op has waited a second write theirs at once)
        store.set(_REQUEST, str(state.world.rank))
    if not _once.counted:
        _once.counted = True
        store.add(_WRITTEN, 1)
    if ask:
        deadline = time.monotonic() + _WAIT
        while time.monotonic() < deadline and store.add(_WRITTEN, 0) < state.world.size:
            time.sleep(0.1)


def before_abort(code: int) -> None:
    """On ``hpccomm._mpi.at_abort``: hpccomm ends the job (MPI_Abort ``code``).  This rank writes
    its record and asks the others for theirs; it waits for them (:data:`_WAIT` at most) unless
    the launcher will end them with SIGTERM, on which each writes its own (Open MPI's, with
    ``HPCCOMM_SIGNAL_REPORT`` on: hpccomm._core.signals): Hydra (MPICH, Intel MPI) sends SIGKILL."""
    from .._mpi import library

    try:
        family = library.family()
        sigterm = family is not None and family.name == "openmpi" and config.get("HPCCOMM_SIGNAL_REPORT")
    except Exception:  # noqa: BLE001 - not known: wait
        sigterm = False
    dump_quietly(f"the job ends (MPI_Abort {code})", ending=True, ask=not sigterm)


def answer() -> bool:
    """The watchdog's part (while an op of this rank has waited a second or more): if a rank
    ending the job asked every rank for its record, write this one's; True once written.  One
    store lookup; never raises."""
    if _once.counted or state.world.size == 1 or state.world.store is None \
            or not config.get("HPCCOMM_FR_BUFFER_SIZE"):
        return False
    try:
        if not state.world.store.check([_REQUEST]):
            return False
    except Exception:  # noqa: BLE001 - the store may be gone with rank 0
        return False
    dump_quietly("another rank ends the job", ending=True)
    return True
