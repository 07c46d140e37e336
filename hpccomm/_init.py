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

from . import _compat, _group, _mpi, config, launcher
from .errors import InitError
from .gpu import dispatch as _gpu
from .process_group import BACKEND_NAME, ProcessGroupHpccomm

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
    """The world communicator a pending or live default group will use."""

    world: Optional[_group.Group] = None  # the hpccomm world group's MPI side
    pending_comm = None  # a comm handed to init_process_group / from_mpi4py
    info: Optional[RankInfo] = None


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


def _bootstrap(comm=None, timeout: timedelta = DEFAULT_TIMEOUT):
    """MPI up, a private world communicator, rank info and a store."""
    MPI = _mpi.mpi()
    _configure_logging()
    base = MPI.COMM_WORLD if comm is None else comm
    _check_launch(MPI.COMM_WORLD)  # the launch is about the world, whatever ``comm`` is
    world_comm = base.Dup()
    info = rank_info(world_comm)
    store = make_store(world_comm, info, timeout)
    _state.pending_comm = world_comm
    _state.info = info
    log.info("MPI %s, thread level %s, world %d ranks on %d node(s), local rank %d/%d",
             _mpi.library_version(), _mpi.thread_level(), info.size, info.nodes, info.local_rank, info.local_size)
    return store, info


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


def _mpi_rendezvous(url: str, timeout: timedelta = DEFAULT_TIMEOUT, **kwargs):
    """``init_method="mpi://"``: rank and size from MPI, a store made over MPI."""
    store, info = _bootstrap(timeout=timeout)
    yield store, info.rank, info.size
    raise InitError("hpccomm: the mpi:// rendezvous cannot be reused after a failure")  # as torch's own handlers


def _tag(ranks) -> int:
    """The MPI_Comm_create_group tag for a group of ``ranks``: derived from the
    members alone, so it is equal on every member whatever else each created
    before (torch's group ids can differ under use_local_synchronization)."""
    tag_ub = _mpi.mpi().COMM_WORLD.Get_attr(_mpi.mpi().TAG_UB) or 32767
    return zlib.crc32(",".join(map(str, ranks)).encode()) % (tag_ub + 1)


def _create(opts, backend_options=None) -> ProcessGroupHpccomm:
    """The creator torch calls for every hpccomm group, on member ranks only."""
    MPI = _mpi.mpi()
    ranks = list(opts.global_ranks_in_group)
    timeout = opts.timeout
    if not ranks:  # the default (world) group
        comm = _state.pending_comm
        _state.pending_comm = None
        if comm is None:  # env:// or another torch rendezvous: MPI learns of it here
            _configure_logging()
            _check_launch(MPI.COMM_WORLD)
            comm = MPI.COMM_WORLD.Dup()
            _state.info = rank_info(comm)
        if (opts.group_rank, opts.group_size) != (comm.Get_rank(), comm.Get_size()):
            mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
            comm.Free()
            _state.info = None
            raise InitError(
                f"hpccomm init: torch's rendezvous says rank {opts.group_rank} of {opts.group_size} but MPI says "
                f"rank {mpi_rank} of {mpi_size}. With env:// the RANK and WORLD_SIZE variables must "
                "match the MPI launch; or use init_method='mpi://' (or hpccomm.init_process_group()), which "
                "takes both from MPI")
        group = _group.Group(comm, range(comm.Get_size()), store=opts.store, timeout=timeout)
        group.is_world = True
        _state.world = group
        _gpu.note_backend_map(group, _compat.requested_device_backends())
        _gpu.bind(_state.info.local_rank, _state.info.local_size)
        _install_excepthook(comm.Get_rank(), comm.Get_size())
        from . import _signals, _trace

        _signals.install(comm, opts.store)

        _trace.start(comm)
        return ProcessGroupHpccomm(group)
    pending, _state.pending_comm = _state.pending_comm, None
    if pending is not None:  # from_mpi4py: the user's communicator, reordered by world rank
        group = _group.Group(pending, ranks, store=opts.store, timeout=timeout)
        _gpu.note_backend_map(group, _compat.requested_device_backends())
        return ProcessGroupHpccomm(group)
    world = _state.world
    if world is None or world.freed:
        parent = _group.Group(MPI.COMM_WORLD, range(MPI.COMM_WORLD.Get_size()), owns_comm=False)
        base = parent  # the default group is not hpccomm: world ranks are MPI's
    else:
        base = world
    group = base.subgroup(ranks, _tag(ranks), store=opts.store, timeout=timeout)
    if base is not world:
        base.free()
    _gpu.note_backend_map(group, _compat.requested_device_backends())
    return ProcessGroupHpccomm(group)


_hook_installed = False


def _install_excepthook(rank: int, size: int) -> None:
    """An uncaught exception on one rank ends the whole job at once, with a
    line saying which rank and where, instead of leaving the other ranks in
    their next collective until the timeout."""
    global _hook_installed
    if _hook_installed or size == 1:
        return
    _hook_installed = True
    import sys

    from . import process_group

    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if not config.get("HPCCOMM_ABORT_ON_EXCEPTION") or _state.world is None or _state.world.freed:
            return
        out = sys.__stderr__
        if sys.stderr is not out:  # torch's own hook captures the traceback to prefix it: print it here
            import traceback

            traceback.print_exception(kind, value, tb, file=out)
        last = process_group._last_op[0]
        where = f"last op: {last[0]} ({last[1].where(last[2])})" if last else "before any op"
        print(f"hpccomm: rank {rank} of {size} raised an uncaught {kind.__name__} ({where}); aborting the job "
              "so the other ranks do not wait for it (HPCCOMM_ABORT_ON_EXCEPTION=0 turns this off)",
              file=out, flush=True)
        from . import _signals

        _signals.record_failure(f"raised an uncaught {kind.__name__} ({where})")
        _mpi.abort(1)

    sys.excepthook = hook


def register() -> None:
    """Make ``backend="hpccomm"`` and ``init_method="mpi://"`` known to torch."""
    _compat.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    _compat.register_rendezvous_handler("mpi", _mpi_rendezvous)


def init_process_group(backend: str = BACKEND_NAME, timeout: Optional[timedelta] = None, comm=None, **kwargs):
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
    :param kwargs: passed on to :func:`torch.distributed.init_process_group`.
    :raises hpccomm.InitError: torch.distributed is already initialised; the
        launch is inconsistent (a launcher started N processes but each sees an
        MPI world of 1, as with srun and the wrong ``--mpi=`` plugin); or the
        key-value store cannot be opened or reached (the message names the
        address and the ``HPCCOMM_STORE_ADDR``/``HPCCOMM_STORE_PORT`` fix).
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
    store, info = _bootstrap(comm, timeout)
    try:
        dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.size,
                                timeout=timeout, **kwargs)
    finally:
        if _state.pending_comm is not None:  # torch failed before our creator took it
            _state.pending_comm.Free()
            _state.pending_comm = None


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
    _state.pending_comm = ordered
    try:
        kw = {} if timeout is None else {"timeout": timeout}
        return dist.new_group(sorted(mine), backend=BACKEND_NAME, use_local_synchronization=True, **kw)
    finally:
        if _state.pending_comm is not None:
            _state.pending_comm.Free()
            _state.pending_comm = None


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
