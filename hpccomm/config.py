"""Runtime options: every ``HPCCOMM_*`` environment variable, declared once.

Each option has a name, a type, a default and a line of documentation; the
docs table and ``hpccomm info`` are generated from :data:`OPTIONS`.

Values are read and validated once, by :func:`load`, which init calls on
every rank before any other MPI call (the ranks agree on the verdict, so a
bad value on one rank raises on all): every ``HPCCOMM_*`` variable is parsed
(words case-insensitively), a malformed one raises
:class:`hpccomm.errors.ConfigError` naming it, and an unknown ``HPCCOMM_*``
name is reported with the nearest valid one.  After that, :func:`get` returns
the loaded value: nothing is read for the first time inside a thread or an
excepthook.  Before init (``hpccomm info``, tests), :func:`get` reads the
environment when asked.  Names starting ``HPCCOMM_TEST_`` belong to the test
suite's runner, not to hpccomm.

Example::

    hpccomm.config.get("HPCCOMM_ON_TIMEOUT")       # after init: the loaded value
    list(hpccomm.config.OPTIONS)                  # the name of every option hpccomm reads
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ConfigError


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    choices: tuple = ()

    def get(self, env=None) -> Any:
        raw = (os.environ if env is None else env).get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            value = self.parse(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{self.name}={raw!r} is not a valid {self.parse.__name__}: {exc}", self.name
            ) from None
        if self.choices and value not in self.choices:
            raise ConfigError(
                f"{self.name}={raw!r} is not one of {', '.join(map(str, self.choices))}", self.name
            )
        return value


def _level(raw: str) -> str:
    return raw.strip().upper()


_level.__name__ = "log level"


def _lower(raw: str) -> str:
    return raw.strip().lower()


_lower.__name__ = "word"


def _positive_int(raw: str) -> int:
    value = int(raw, 0)
    if value <= 0:
        raise ValueError("must be positive")
    return value


_positive_int.__name__ = "positive integer"


def _count(raw: str) -> int:
    value = int(raw, 0)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


_count.__name__ = "count"


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be in 0..65535")
    return value


_port.__name__ = "port"


#: The op families of CUDA tensors and the routes HPCCOMM_GPU_ROUTES may force (hpccomm._gpu.select).
GPU_FAMILIES = ("reduction", "reduce_scatter", "movement", "p2p")
#: The families that reduce: the ones the ``composed`` route serves.
GPU_REDUCING = GPU_FAMILIES[:2]
GPU_ROUTES = ("mpi", "composed", "nccl", "staged")


def _routes(raw: str) -> tuple:
    """``"reduction=composed,movement=nccl"`` as sorted ``(family, route)`` pairs."""
    pairs = {}
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        family, sep, name = (x.strip().lower() for x in item.partition("="))
        if not sep or family not in GPU_FAMILIES or name not in GPU_ROUTES:
            raise ValueError(f"{item!r} is not FAMILY=ROUTE with FAMILY one of {', '.join(GPU_FAMILIES)} and ROUTE "
                             f"one of {', '.join(GPU_ROUTES)}")
        if name == "composed" and family not in GPU_REDUCING:
            raise ValueError(f"{item!r}: hpccomm composes reductions only")
        pairs[family] = name
    return tuple(sorted(pairs.items()))


_routes.__name__ = "route list"


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


_bool.__name__ = "boolean"

OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "HPCCOMM_LOG", _level, "WARNING",
            "Log level of the 'hpccomm' logger: INFO logs init (MPI library, thread "
            "level, communicator sizes), DEBUG also logs every op.",
            ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"),
        ),
        Option(
            "HPCCOMM_MAX_MPI_COUNT", _positive_int, 2**31 - 1,
            "Largest element count handed to one MPI call. Larger messages are split "
            "into several calls (MPI-3 counts are C ints). Lower it only to test the "
            "split paths.",
        ),
        Option(
            "HPCCOMM_DEBUG", _level, "OFF",
            "DETAIL: before every collective the ranks compare op, dtype, sizes, root and ReduceOp, "
            "and a mismatch raises on every rank naming both sides (torch's "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL turns it on too). Costs one allgather per op.",
            ("OFF", "INFO", "DETAIL"),
        ),
        Option(
            "HPCCOMM_MISMATCH_CHECK", _lower, "every",
            "Every (the default): every collective call is compared across its group's ranks before any data "
            "moves (one allreduce of 56 bytes per call: a fingerprint of its signature, the op, every tensor's "
            "dtype and element count, the ReduceOp, the root, all_to_all's splits), and a mismatch raises on "
            "every rank naming each rank's call. 'first': only the first call of each signature on a group "
            "(later calls of an agreed signature run at once). 'off': no comparison (an MPI error or wrong "
            "data, as MPI gives). Set it alike on every rank. HPCCOMM_DEBUG=DETAIL compares every call's "
            "whole description instead.",
            ("every", "first", "off"),
        ),
        Option(
            "HPCCOMM_ASYNC_NONBLOCKING", _bool, False,
            "On: async_op=True all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast "
            "of up to 64 KiB are posted as nonblocking MPI collectives from the calling thread (no "
            "comm-thread wake: a few us faster per op) where HPCCOMM_MISMATCH_CHECK is first or off; "
            "with the every-call check on (the default) they take their nonblocking form on the comm "
            "thread, where the check, which waits for the other ranks, runs. Every rank must then pass "
            "the same async_op "
            "for a collective (MPI never matches a nonblocking collective with a blocking one), which "
            "torch's DDP Join (uneven inputs) does not do, so it is off by default. Set it alike on "
            "every rank.",
        ),
        Option(
            "HPCCOMM_ON_TIMEOUT", _lower, "abort",
            "What a rank does when a collective outlives its group's timeout (given to init or "
            "new_group): 'abort' ends the whole job with MPI_Abort after printing which ranks never "
            "arrived (MPI cannot cancel a collective); 'warn' prints the same and keeps waiting.",
            ("abort", "warn"),
        ),
        Option(
            "HPCCOMM_ABORT_ON_EXCEPTION", _bool, True,
            "An uncaught Python exception on one rank of a multi-rank job prints a line naming the "
            "rank and its last op, then ends the whole job with MPI_Abort (the other ranks would "
            "otherwise wait in their next collective until the timeout).",
        ),
        Option(
            "HPCCOMM_SIGNAL_REPORT", _bool, True,
            "When the launcher ends a rank with SIGTERM (because another rank died), print one line "
            "saying which op this rank was in and which rank failed, then exit with status 143. "
            "Installed at init only if the program has no SIGTERM handler of its own.",
        ),
        Option(
            "HPCCOMM_FR_BUFFER_SIZE", _count, 2000,
            "The flight recorder: how many of its last ops each group keeps on each rank (op, sizes, dtypes, "
            "state, times, op numbers), written on a timeout, a mismatch, a failed rank, before hpccomm ends "
            "the job, and on hpccomm.dump_flight_record(), to the file torch's own recorders use "
            "(TORCH_FR_DUMP_TEMP_FILE + rank, by default ~/.cache/torch/comm_lib_trace_rank_<rank>), which "
            "python -m torch.distributed.flight_recorder.fr_trace reads. 0 turns it off.",
        ),
        Option(
            "HPCCOMM_TRACE", str, "",
            "A file name: record every op on every rank and write one merged Chrome/Perfetto trace "
            "(a process per rank) when the world group is destroyed.",
        ),
        Option(
            "HPCCOMM_STORE_ADDR", str, "",
            "Address rank 0 advertises for the key-value store (a TCPStore). Default: "
            "127.0.0.1 when all ranks share one node, else rank 0's host address.",
        ),
        Option(
            "HPCCOMM_STORE_PORT", _port, 0,
            "Port of the key-value store on rank 0; 0 picks a free port.",
        ),
        Option(
            "HPCCOMM_GPU_TRANSPORT", _lower, "auto",
            "How CUDA tensors travel, per group, device and op family (the routes logged at INFO and shown by "
            "hpccomm info; docs/gpu.md has the table). 'auto' chooses from every member's findings: reductions "
            "through NCCL unless the CUDA-aware MPI reduces on the device, data movement and point-to-point "
            "through CUDA-aware MPI; without CUDA-aware MPI, collectives through NCCL and point-to-point staged; "
            "where NCCL cannot serve (ranks sharing a GPU), CUDA-aware MPI, else staged. 'mpi', 'nccl' "
            "(torch's NCCL, or CuPy's) and 'staged' (copies through reused pinned host buffers) force one "
            "transport for every op; what NCCL cannot take exactly goes to CUDA-aware MPI or staged. Also "
            "hpccomm.gpu.set_transport(name, group).",
            ("auto", "mpi", "composed", "nccl", "staged"),
        ),
        Option(
            "HPCCOMM_GPU_ROUTES", _routes, (),
            "The route of single op families of CUDA tensors, forced on top of HPCCOMM_GPU_TRANSPORT: "
            "'reduction=composed,movement=nccl' (families: reduction, reduce_scatter (the reduce_scatter ops; "
            "it follows a forced reduction route unless named itself), movement, p2p; routes: mpi, composed "
            "(reductions only: hpccomm's ring over the MPI library's point-to-point messages), nccl, staged). "
            "Also hpccomm.gpu.set_routes(group, reduction=...).",
        ),
        Option(
            "HPCCOMM_ADAPTER", _lower, "auto",
            "How hpccomm plugs into torch (torch >= 2.14; torch 2.13 takes only 'process_group'). "
            "'process_group': a whole ProcessGroup whose methods torch's Python calls reach directly (about "
            "5 us faster per op), with hpccomm's Backend registered in it for torch's per-device machinery "
            "(batch_isend_irecv, split_group); it keeps what torch's Backend trampoline loses (a receive from "
            "any source reporting its sender, Work.is_completed(), dist.gather_single). 'backend': a c10d "
            "Backend inside torch's own ProcessGroup, the only way torch honours a per-device string such "
            "as 'cpu:hpccomm,cuda:nccl'. 'auto': backend for such a string, else process_group.",
            ("auto", "backend", "process_group"),
        ),
        Option(
            "HPCCOMM_GPU_BIND", _lower, "local_rank",
            "Which GPU each rank uses: 'local_rank' calls torch.cuda.set_device(local rank modulo the GPU count) "
            "when the process first uses CUDA (a CPU job never touches CUDA; a device the program set stands); "
            "'none' leaves the current device alone (bind it yourself, for example from CUDA_VISIBLE_DEVICES "
            "per rank).",
            ("local_rank", "none"),
        ),
        Option(
            "HPCCOMM_FAULT_TOLERANCE", _lower, "off",
            "Survive a lost rank with 'ulfm' (Open MPI's User Level Failure Mitigation; launch with "
            "mpirun --with-ft ulfm): every survivor's op raises hpccomm.RankFailure naming the dead ranks, "
            "and hpccomm.shrink() goes on without them (docs/fault-tolerance.md). 'off': a lost rank ends "
            "the job. Also init_process_group(fault_tolerance=...).",
            ("off", "ulfm"),
        ),
    )
}


_loaded: dict = {}  # name -> value, filled by load()
log = logging.getLogger("hpccomm")


def get(name: str) -> Any:
    """The value of option ``name`` (for example ``"HPCCOMM_LOG"``): as
    loaded at init, or read from the environment now if not loaded yet."""
    if name in _loaded:
        return _loaded[name]
    return OPTIONS[name].get()


def load(env=None) -> dict:
    """Read and validate every ``HPCCOMM_*`` option (``env``: default
    ``os.environ``); from now on :func:`get` returns these values.  Returns
    them.  Raises :class:`~hpccomm.errors.ConfigError` for the first
    malformed value; unknown ``HPCCOMM_*`` names are reported (logged as a
    warning) with the nearest valid name."""
    import difflib

    env = os.environ if env is None else env
    for name in unknown(env):
        near = difflib.get_close_matches(name, OPTIONS, n=1)
        log.warning("hpccomm: %s is not an hpccomm setting (ignored)%s", name,
                    f"; did you mean {near[0]}?" if near else f"; the settings are {', '.join(OPTIONS)}")
    values = {name: opt.get(env) for name, opt in OPTIONS.items()}
    _loaded.clear()
    _loaded.update(values)
    return dict(values)


def unknown(env=None) -> list:
    """The ``HPCCOMM_*`` names in ``env`` that are not options (test-runner
    variables ``HPCCOMM_TEST_*`` excepted)."""
    env = os.environ if env is None else env
    return sorted(k for k in env if k.startswith("HPCCOMM_") and k not in OPTIONS
                  and not k.startswith("HPCCOMM_TEST_"))


def loaded() -> dict:
    """The values :func:`load` took (empty before init)."""
    return dict(_loaded)


def reset() -> None:
    """Forget the loaded values (tests; a later init loads them again)."""
    _loaded.clear()
