"""Start-up: the backend creator torch calls, the ``mpi://`` rendezvous, the
key-value store, and hpccomm's own ``init_process_group``.

Registering the backend with torch is cheap and happens at ``import hpccomm``;
MPI itself starts only when a process group is made.
"""
from __future__ import annotations

import logging
import os
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from . import _compat, _ft, _group, _mpi, _quiesce, _status, config, launcher  # noqa: F401 - _quiesce: exit hook
from ._adapter import BACKEND_NAME
from ._watchdog import watchdog
from .errors import ConfigError, InitError
from .gpu import dispatch as _gpu

log = logging.getLogger("hpccomm")

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for CPU backends


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


class _State:
    """What the creator torch calls needs to know, and the live world group."""

    world: Optional[_group.Group] = None  # the hpccomm world group's MPI side
    world_comm = None  # the world's communicator, made by hpccomm.init_process_group (comm=...)
    sub_comm = None  # the communicator hpccomm.from_mpi4py hands to the creator
    info: Optional[RankInfo] = None
    ft_mode: Optional[str] = None  # init_process_group(fault_tolerance=...), None: HPCCOMM_FAULT_TOLERANCE


_state = _State()


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
            store = _compat.TCPStore(host, config.get("HPCCOMM_STORE_PORT"), size, is_master=True,
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
            store = _compat.TCPStore(addr[0], addr[1], size, is_master=False,
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
    if kind == "ConfigError":
        raise ConfigError(message, variable)
    raise InitError(message)


def _start(comm=None, timeout: Optional[timedelta] = None):
    """MPI up; settings and the launch checked on every rank together.
    Returns the communicator whose ranks form the world (``comm`` or COMM_WORLD).
    ``timeout``: how long MPI_Init may take before this process is ended with
    a message (hpccomm._mpi._init_watch); default DEFAULT_TIMEOUT."""
    _ft.prepare_mpi(_ft.requested(_state.ft_mode))  # before MPI_Init
    MPI = _mpi.mpi(init_timeout=(timeout or DEFAULT_TIMEOUT).total_seconds())
    world = MPI.COMM_WORLD
    mode = []

    def check():
        config.load()  # every HPCCOMM_* value, validated once
        _check_adapter(config.get("HPCCOMM_ADAPTER"))
        _check_launch(world)  # the launch is about the world, whatever ``comm`` is
        mode.append(_ft.requested(_state.ft_mode))
        _ft.check_launch(mode[0])

    base = world if comm is None else comm
    agree(base, check)  # over the ranks that called init: with ``comm`` given, the others may never come
    _agree_fault_tolerance(base, mode[0])
    _configure_logging()
    return base


def _agree_fault_tolerance(comm, mode: str) -> None:
    """Every rank of ``comm`` runs in the same fault-tolerance mode, or
    every rank raises (one allgather of the mode's name)."""
    if comm.Get_size() > 1:
        modes = comm.allgather(mode)
        if len(set(modes)) > 1:
            said = ", ".join(f"rank {r}: {m}" for r, m in enumerate(modes))
            raise ConfigError(f"hpccomm init: the ranks disagree on fault tolerance ({said}); set "
                              "HPCCOMM_FAULT_TOLERANCE (or init_process_group's fault_tolerance) alike on every rank",
                              "HPCCOMM_FAULT_TOLERANCE")
    _ft.enable(mode)


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
    _state.info = info
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
    MASTER_ADDR/MASTER_PORT (see :mod:`hpccomm._plugin`), for any backend and
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


def _tag(ranks) -> int:
    """The MPI_Comm_create_group tag for a group of ``ranks``: derived from the
    members alone, so it is equal on every member whatever else each created
    before (torch's group ids can differ under use_local_synchronization)."""
    tag_ub = _mpi.mpi().COMM_WORLD.Get_attr(_mpi.mpi().TAG_UB) or 32767
    return zlib.crc32(",".join(map(str, ranks)).encode()) % (tag_ub + 1)


def _create(opts, backend_options=None):
    """The creator torch calls for every hpccomm group, on member ranks only;
    returns the adapter this torch takes (:func:`hpccomm._compat.make_adapter`)."""
    ranks = list(opts.global_ranks_in_group)
    if not ranks:  # the default (world) group
        group = _world_group(opts)
    else:
        group = _subgroup(opts, ranks)
    if getattr(opts, "group_id", ""):  # torch's name for the group (torch 2.13 also sets it later)
        group.name = str(opts.group_id)
    device_backends = _compat.requested_device_backends()
    _gpu.note_backend_map(group, device_backends)
    return make_adapter(group, backend_options, config.get("HPCCOMM_ADAPTER"), device_backends)


def _world_group(opts) -> _group.Group:
    """The default group's MPI side: every MPI rank of the world calls this."""
    comm, _state.world_comm = _state.world_comm, None
    if comm is None:  # a torch rendezvous (env://, tcp://, mpi://, a store): MPI learns of it here
        base = _start(timeout=opts.timeout)
        comm = base.Dup()

        def same_ranks():
            if (opts.group_rank, opts.group_size) != (comm.Get_rank(), comm.Get_size()):
                raise InitError(
                    f"hpccomm init: torch's rendezvous says rank {opts.group_rank} of {opts.group_size} but MPI "
                    f"says rank {comm.Get_rank()} of {comm.Get_size()}. With env:// the RANK and WORLD_SIZE "
                    "variables must match the MPI launch; or use init_method='mpi://' (or "
                    "hpccomm.init_process_group()), which takes both from MPI")

        try:
            agree(comm, same_ranks)
            if _state.info is None or _state.info.size != comm.Get_size():
                _state.info = rank_info(comm)
        except BaseException:
            comm.Free()
            _state.info = None
            raise
    group = _group.Group(comm, range(comm.Get_size()), store=opts.store, timeout=opts.timeout)
    group.is_world = True
    _state.world = group
    _gpu.bind(_state.info.local_rank, _state.info.local_size)
    _install_excepthook(comm.Get_rank(), comm.Get_size())
    from . import _signals, _trace

    _signals.install(comm, opts.store)
    _trace.start(comm)
    return group


def _subgroup(opts, ranks) -> _group.Group:
    """A subgroup's MPI side, built by its members only (torch calls the
    creator on members only), whatever backend the default group has."""
    pending, _state.sub_comm = _state.sub_comm, None
    if pending is not None:  # from_mpi4py: the user's communicator, reordered by world rank
        return _group.Group(pending, ranks, store=opts.store, timeout=opts.timeout)
    world = _state.world
    creating = _Creating(ranks, opts)
    if world is not None and not world.freed:
        from ._engine import engine

        engine.flush(world)  # the comm thread must be done with the parent communicator
        parent = world.comm
    else:  # the default group is not hpccomm: its ranks must be MPI_COMM_WORLD's
        _members_agree(opts, ranks, creating)
        parent = _mpi.mpi().COMM_WORLD
    tag = _tag(ranks)
    token = watchdog.begin(creating, "new_group (MPI_Comm_create_group)", 0)
    try:
        if _status.failures.tolerant:
            _ft.meet(parent, ranks, tag)  # a member that died raises here, not a hang in MPI_Comm_create_group
        comm = _group.create_group(parent, ranks, tag)
    except _mpi.mpi().Exception as exc:
        failure = _ft.failure(f"new_group ({creating.where()})", exc) if _status.failures.tolerant else None
        if failure is None:
            raise
        raise failure from exc  # a member died (fault-tolerance mode): hpccomm.RankFailure
    finally:
        watchdog.end(token)
    return _group.Group(comm, ranks, store=opts.store, timeout=opts.timeout)


class _Creating:
    """A group being created, as the watchdog sees it (members only; the
    diagnosis of a timeout goes through the new group's store)."""

    def __init__(self, ranks, opts) -> None:
        self.global_ranks = list(ranks)
        self.rank, self.size = opts.group_rank, opts.group_size
        self.name = f"new group of ranks {list(ranks)}"
        self.store = opts.store
        self.timeout = opts.timeout
        seconds = opts.timeout.total_seconds() if opts.timeout is not None else 0
        self.timeout_s = seconds if seconds > 0 else None

    def where(self, seq=None) -> str:
        return f"creating the {self.name}, rank {self.rank}/{self.size}"

    where_p2p = where


_made_before: dict = {}  # members -> groups of exactly them this process agreed on before


def _members_agree(opts, ranks, creating) -> None:
    """Under a default group of another backend, before any MPI call: every
    member checks that MPI is started, its settings, and that its torch rank
    is its MPI_COMM_WORLD rank; the members agree through the new group's
    store (they have no communicator yet), so a refusal raises on every
    member instead of leaving some waiting in MPI."""
    mine = ranks[opts.group_rank]
    verdict = ""
    if not _mpi.started():
        verdict = (f"MPI is not started on rank {mine}: an hpccomm group under a default group of another backend "
                   "needs MPI started on every rank beforehand (MPI_Init waits for all ranks, and torch calls "
                   "the group's creator on its members only). Initialise with "
                   "hpccomm.init_process_group(backend=...) or import mpi4py.MPI on every rank first")
    else:
        try:
            config.load()
        except ConfigError as exc:
            verdict = str(exc)
        else:
            mpi_rank = _mpi.mpi().COMM_WORLD.Get_rank()
            if mpi_rank != mine:
                verdict = (f"the default process group's ranks are not MPI's (torch rank {mine} is MPI rank "
                           f"{mpi_rank}): an hpccomm group under a default group of another backend needs the "
                           "default group's ranks to be MPI_COMM_WORLD's. Launch with the MPI launcher and let "
                           "RANK follow it (or initialise with hpccomm.init_process_group(backend=...))")
    # torch's name for the group (and so opts.store's prefix) can differ between members made with
    # use_local_synchronization=True (it counts each rank's groups): meet in the default store under a
    # key of the members alone, and how many groups of exactly these members this process made before.
    store = _compat.default_store() or opts.store
    nth = _made_before.get(tuple(ranks), 0)
    _made_before[tuple(ranks)] = nth + 1
    prefix = f"hpccomm/members/{','.join(map(str, ranks))}/{nth}/"
    store.set(prefix + str(opts.group_rank), verdict)
    keys = [prefix + str(r) for r in range(opts.group_size)]
    try:
        store.wait(keys, opts.timeout)
    except Exception as exc:  # noqa: BLE001 - torch raises its own timeout types
        raise InitError(f"hpccomm new_group ({creating.where()}): not every member arrived within "
                        f"{opts.timeout} ({_text(exc)})") from None
    for r, key in enumerate(keys):
        said = store.get(key).decode()
        if said:
            raise InitError(f"hpccomm new_group ({creating.where()}): {said}"
                            + ("" if r == opts.group_rank else f" (as rank {ranks[r]} reports)"))
    if _state.info is None:
        _configure_logging()


def _check_adapter(adapter: str) -> None:
    if adapter == "backend" and not _compat.py_backend():
        raise ConfigError(f"HPCCOMM_ADAPTER=backend needs torch >= 2.14 (a Python c10d Backend); this torch "
                          f"{_compat.torch.__version__} takes a ProcessGroup: unset it", "HPCCOMM_ADAPTER")


def make_adapter(group, backend_options=None, adapter: str = "auto", device_backends=None):
    """What the backend creator returns to torch for ``group`` (a
    :class:`hpccomm._group.Group`).

    torch 2.13 takes only a whole ``ProcessGroup``.  On torch >= 2.14 both
    adapters work; ``auto`` picks, per group, the faster one where both
    serve the request: the ``ProcessGroup`` adapter (with hpccomm's
    ``Backend`` registered in it for every device, so torch's per-device
    machinery reaches hpccomm too) for a plain ``"hpccomm"`` backend string,
    and the ``Backend`` when the string sends some device to another
    backend (``"cpu:hpccomm,cuda:nccl"``), which only a Backend lets torch
    honour.  ``HPCCOMM_ADAPTER`` forces one (docs/design.md, "Torch versions").
    """
    _check_adapter(adapter)
    use_backend = _compat.py_backend() and (
        adapter == "backend" or (adapter == "auto" and any(
            str(b).lower() != BACKEND_NAME for b in (device_backends or {}).values())))
    if use_backend:
        from .backend import BackendHpccomm

        if backend_options is not None and not isinstance(backend_options, _compat.BackendOptions):
            backend_options = None  # torch's own option objects (ProcessGroupGloo.Options...) are not ours
        return BackendHpccomm(group, backend_options)
    from .process_group import ProcessGroupHpccomm

    return ProcessGroupHpccomm(group)


_hook_installed = False


def _install_excepthook(rank: int, size: int) -> None:
    """An uncaught exception on one rank ends the whole job at once, with a
    line saying which rank and where, instead of leaving the other ranks in
    their next collective until the timeout."""
    global _hook_installed
    if _hook_installed or size == 1 or not config.get("HPCCOMM_ABORT_ON_EXCEPTION"):
        return
    _hook_installed = True
    import sys

    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if _state.world is None or _state.world.freed:
            return
        out = sys.__stderr__
        if sys.stderr is not out:  # torch's own hook captures the traceback to prefix it: print it here
            import traceback

            traceback.print_exception(kind, value, tb, file=out)
        where = _status.last_op_text()
        rank, size = _status.world.rank, _status.world.size  # as renumbered by hpccomm.shrink()
        print(f"hpccomm: rank {rank} of {size} raised an uncaught {kind.__name__} ({where}); aborting the job "
              "so the other ranks do not wait for it (HPCCOMM_ABORT_ON_EXCEPTION=0 turns this off)",
              file=out, flush=True)
        _status.record_failure(f"raised an uncaught {kind.__name__} ({where})")
        _mpi.abort(1)

    sys.excepthook = hook


def register() -> None:
    """Make ``backend="hpccomm"`` and ``init_method="mpi://"`` known to torch."""
    from . import _plugin

    _plugin.register()


def init_process_group(backend: str = BACKEND_NAME, timeout: Optional[timedelta] = None, comm=None,
                       fault_tolerance: Optional[str] = None, **kwargs):
    """Initialise torch.distributed over MPI: one call under mpirun, mpiexec or srun.

    Rank and world size come from MPI (from ``comm``, an mpi4py communicator,
    default COMM_WORLD); the key-value store torch needs is opened by rank 0
    and its address broadcast over MPI, so no MASTER_ADDR or port is needed.
    Collective: every rank of ``comm`` must call it.

    :param backend: the torch backend name; ``"hpccomm"`` (the default).
    :param timeout: a :class:`datetime.timedelta`: how long any collective of the
        default group may take before the job is ended with a message naming the
        ranks that never arrived (see ``HPCCOMM_ON_TIMEOUT``); default 30 minutes.
    :param comm: the mpi4py communicator whose ranks form the world (default
        ``MPI.COMM_WORLD``); hpccomm works on a private duplicate of it.
    :param fault_tolerance: ``"ulfm"`` survives a lost rank (launch with
        ``mpirun --with-ft ulfm``; see :func:`hpccomm.shrink` and
        docs/fault-tolerance.md); ``"off"``; default ``HPCCOMM_FAULT_TOLERANCE``
        (off).  Every rank must ask for the same.
    :param kwargs: passed on to :func:`torch.distributed.init_process_group`.
    :raises hpccomm.InitError: torch.distributed is already initialised; the
        launch is inconsistent (a launcher started N processes but each sees an
        MPI world of 1, as with srun and the wrong ``--mpi=`` plugin); the
        key-value store cannot be opened or reached (the message names the
        address and the ``HPCCOMM_STORE_ADDR``/``HPCCOMM_STORE_PORT`` fix); or
        fault tolerance was asked for where a failure cannot be survived (not
        Open MPI with ULFM, no ``--with-ft ulfm``; the message names the fix).
    :raises hpccomm.ConfigError: an ``HPCCOMM_*`` variable has a malformed value.

    Example::

        import hpccomm, torch, torch.distributed as dist
        hpccomm.init_process_group()
        t = torch.ones(4)
        dist.all_reduce(t)          # t == world size everywhere
        dist.destroy_process_group()
    """
    if dist.is_initialized():
        raise InitError("hpccomm.init_process_group: torch.distributed is already initialised; call "
                        "dist.destroy_process_group() first")
    register()
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    _state.ft_mode = fault_tolerance
    store, info, _state.world_comm = _bootstrap(comm, timeout)
    try:
        dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.size,
                                timeout=timeout, **kwargs)
    finally:
        if _state.world_comm is not None:  # another backend, or torch failed before our creator took it
            _state.world_comm.Free()
            _state.world_comm = None


def from_mpi4py(comm, timeout: Optional[timedelta] = None):
    """A torch process group over the ranks of ``comm``, an mpi4py communicator.

    Called by the members of ``comm`` only, after the default group exists
    (any backend; its ranks must be MPI_COMM_WORLD's).  The group communicates
    on a private duplicate of ``comm``; its ranks follow world-rank order, as
    torch's ``new_group`` does.  Returns what ``dist.new_group`` returns.

    :param comm: an mpi4py intracommunicator whose processes are all in the
        torch world (for example from ``MPI.COMM_WORLD.Split``).
    :param timeout: a :class:`datetime.timedelta` for the group's collectives;
        default: the default group's.
    :raises hpccomm.InitError: torch.distributed is not initialised yet, or
        ``comm`` has processes outside the torch world.

    Example::

        sub = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
        pg = hpccomm.from_mpi4py(sub)
        dist.all_reduce(t, group=pg)
    """
    MPI = _mpi.mpi()
    if not dist.is_initialized():
        raise InitError("hpccomm.from_mpi4py: initialise torch.distributed first (hpccomm.init_process_group)")
    world = _state.world.comm if _state.world is not None and not _state.world.freed else MPI.COMM_WORLD
    group = comm.Get_group()
    try:
        mine = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world.Get_group())
    finally:
        group.Free()
    if any(r == MPI.UNDEFINED for r in mine):
        raise InitError("hpccomm.from_mpi4py: the communicator has processes outside the torch world")
    ordered = comm.Split(0, key=mine[comm.Get_rank()])  # group rank order = world rank order
    _state.sub_comm = ordered
    try:
        kw = {} if timeout is None else {"timeout": timeout}
        with _compat.members_only_naming(mine):  # torch's group counter stays as the non-members have it
            return dist.new_group(sorted(mine), backend=BACKEND_NAME, use_local_synchronization=True, **kw)
    finally:
        if _state.sub_comm is not None:
            _state.sub_comm.Free()
            _state.sub_comm = None


def rebuild_world(comm, survivors, old_groups, timeout=None) -> dict:
    """torch's world made again over ``comm``, the survivors' communicator
    (hpccomm._ft.shrink, after MPI_Comm_shrink; collective over ``comm``).

    ``survivors``: the old world ranks of ``comm``'s ranks, in order;
    ``old_groups``: every hpccomm Group of this rank (revoked, their queues
    drained).  A new key-value store is opened on the new rank 0 (the old
    one may have died with the old rank 0); the default group is destroyed
    and made again with the same backend string and timeout (``timeout``
    overrides it); every hpccomm subgroup that any survivor is a member of
    is made again over its surviving members, renumbered in the same order,
    by every survivor in one agreed order (``dist.new_group``).  Returns
    ``{old group: new group}`` for this rank's subgroups."""
    old_world = _state.world
    timeout = timeout or old_world.timeout or DEFAULT_TIMEOUT
    backend = dist.get_backend()  # the string init was given (dist.get_backend() says the same after)
    info = rank_info(comm)
    store = make_store(comm, info, timeout)
    # Every survivor's hpccomm subgroups: each rank knows only its own, and dist.new_group wants all ranks.
    mine = {}
    for pg, ranks in _compat.process_groups():
        g = _compat.group_of(pg)
        if g is not None and g is not old_world:
            mine[g.key] = (tuple(ranks), g.timeout_s, dist.get_backend(pg), pg)
    known = {}
    for part in comm.allgather({key: entry[:3] for key, entry in mine.items()}):
        known.update(part)
    order = sorted(known, key=lambda key: (known[key][0], key))
    for g in old_groups:
        g.free(flush=False)  # revoked, drained by the caller: nothing runs on them any more
    _state.info = info
    dist.destroy_process_group()
    _state.world_comm = comm
    try:
        dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.size, timeout=timeout)
    finally:
        if _state.world_comm is not None:  # torch failed before our creator took it
            _state.world_comm.Free()
            _state.world_comm = None
    new_rank = {old: new for new, old in enumerate(survivors)}
    made = {}
    for key in order:
        ranks, seconds, group_backend = known[key]
        members = [new_rank[r] for r in ranks if r in new_rank]
        if not members:
            continue
        kw = {} if not seconds else {"timeout": timedelta(seconds=seconds)}
        pg = dist.new_group(members, backend=group_backend, **kw)
        if key in mine:
            made[mine[key][3]] = pg
    return made


def shrunk_backend(g, comm, survivors, opts=None):
    """The Backend over ``comm``, the survivors of group ``g``'s
    communicator, for ``dist.shrink_group`` (torch >= 2.14; hpccomm._ft).

    A new key-value store is opened on its rank 0 and handed to torch as the
    old group's store (torch clones it for the new group: the old one may
    have died with the old rank 0).  For the default group the new group
    becomes hpccomm's world."""
    from .backend import BackendHpccomm

    world = g.is_world
    timeout = g.timeout or DEFAULT_TIMEOUT
    info = rank_info(comm) if world else None
    store = make_store(comm, info or RankInfo(comm.Get_rank(), comm.Get_size(), 0, 1, 0, _nodes(comm)), timeout)
    target = _compat.default_group_or_none() if world else next(
        (pg for pg, _ in _compat.process_groups() if _compat.group_of(pg) is g), None)
    if target is not None:
        _compat.replace_group_store(target, store)
    ranks = list(range(len(survivors))) if world else [g.global_ranks[r] for r in survivors]
    child = _group.Group(comm, ranks, store=store, timeout=g.timeout)
    g.free(flush=False)
    if world:
        from . import _signals

        child.is_world = True
        _state.world, _state.info = child, info
        _signals.install(comm, store)  # every rank's host and pid, renumbered
    return BackendHpccomm(child, opts)


def _nodes(comm) -> int:
    """How many nodes ``comm``'s ranks are on (collective)."""
    import socket

    return len(set(comm.allgather(socket.gethostname())))


def mpi_comm(group=None):
    """The mpi4py communicator an hpccomm process group's collectives run on.

    :param group: a torch process group made with backend hpccomm (default:
        the default group).
    :returns: an ``mpi4py.MPI.Intracomm`` owned by hpccomm (do not free it;
        communicate on a ``Dup()`` of it), or None once the group is destroyed.
    :raises hpccomm.HpccommError: ``group`` is not an hpccomm group, or
        torch.distributed is not initialised.

    Example::

        comm = hpccomm.mpi_comm()           # the world's communicator
        assert comm.Get_size() == dist.get_world_size()
    """
    from .errors import HpccommError

    if group is None:
        if not dist.is_initialized():
            raise HpccommError("hpccomm.mpi_comm: torch.distributed is not initialised")
        group = _compat.world_group()
    g = _compat.group_of(group)
    if g is None:
        raise HpccommError(f"hpccomm.mpi_comm: {group!r} is not an hpccomm process group "
                           f"(its backend is {dist.get_backend(group)!r})")
    return g.comm


def local_rank() -> int:
    """This process's rank among the ranks on its node, 0..local_size()-1.

    Known after :func:`hpccomm.init_process_group` (or any hpccomm init); it
    follows the launcher's local numbering when it gives one, so it is the
    index to pick a GPU or a core set with.

    :raises hpccomm.InitError: hpccomm is not initialised.

    Example::

        hpccomm.init_process_group()
        device = torch.device("cuda", hpccomm.local_rank())
    """
    return _require_info().local_rank


def local_size() -> int:
    """How many ranks share this node (its shared-memory domain).

    :raises hpccomm.InitError: hpccomm is not initialised.

    Example::

        torch.set_num_threads(max(1, os.cpu_count() // hpccomm.local_size()))
    """
    return _require_info().local_size


def node_index() -> int:
    """This node's index, 0..nodes-1, in order of the lowest rank on each node.

    :raises hpccomm.InitError: hpccomm is not initialised.

    Example::

        if hpccomm.local_rank() == 0:
            print(f"node {hpccomm.node_index()} has {hpccomm.local_size()} ranks")
    """
    return _require_info().node


def _require_info() -> RankInfo:
    if _state.info is None:
        raise InitError("hpccomm: not initialised; call hpccomm.init_process_group() first")
    return _state.info
