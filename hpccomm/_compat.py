"""Every version-sensitive symbol of torch, in one place.

The rest of hpccomm imports torch's distributed internals only from here.
Which adapter torch gets is decided once, here, by feature test (not by
version number): :func:`py_backend` is True when this torch dispatches a
Python subclass of its C++ ``Backend`` (the ``PyBackend`` trampoline of
torch >= 2.14); then hpccomm is a ``Backend`` (``hpccomm._adapters.backend``), else a
whole ``ProcessGroup`` (``hpccomm._adapters.process_group``, torch 2.13).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

#: The C++-backed base classes a Python backend derives from.
ProcessGroupBase = dist.ProcessGroup
WorkBase = dist.Work
BackendBase = getattr(_c10d, "Backend", None)
BackendOptions = getattr(BackendBase, "Options", None)


def _python_backend() -> bool:
    """Whether a Python subclass of torch's C++ ``Backend`` can be made (and
    is then dispatched through the ``PyBackend`` trampoline): torch 2.13's
    Backend has no constructor for Python; torch >= 2.14's does."""
    if BackendBase is None or BackendOptions is None:
        return False
    try:
        probe = type("_Probe", (BackendBase,), {})(0, 1)
    except TypeError:
        return False
    del probe
    return True


_py_backend: list = []


def py_backend() -> bool:
    """True: hpccomm is a ``Backend`` for this torch (torch >= 2.14); False:
    a whole ``ProcessGroup`` (torch 2.13).  Decided once, by feature test."""
    if not _py_backend:
        _py_backend.append(_python_backend())
    return _py_backend[0]


def group_of(pg):
    """The :class:`hpccomm._core.group.Group` behind torch group ``pg``, or None
    when ``pg`` is not an hpccomm group."""
    g = getattr(pg, "_g", None)  # the torch 2.13 adapter is the group itself
    if g is not None:
        return g
    get_backend = getattr(pg, "_get_backend", None)
    if get_backend is None:
        return None
    try:
        backend = get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    return getattr(backend, "_g", None)
ReduceOp = dist.ReduceOp
RedOpType = dist.ReduceOp.RedOpType


def reduce_op_type(op) -> "RedOpType":
    """The ``RedOpType`` of ``op`` (a ``ReduceOp`` or a ``RedOpType``)."""
    if isinstance(op, RedOpType):
        return op
    return op.op


#: The kind's value of PREMUL_SUM, whose factor varies from call to call (never part of a cache key).
PREMUL_SUM_CODE = int(RedOpType.PREMUL_SUM.value)


def _code_by_attribute(op) -> int:
    return int(op.value if op.__class__ is RedOpType else op.op.value)


def _hash_is_code() -> bool:
    """Whether ``hash`` of a ReduceOp and of a RedOpType is its kind's value
    (torch 2.13-2.15 define ``ReduceOp.__hash__`` so; pybind's enums hash to
    their value)."""
    try:
        return all(hash(ReduceOp(k)) == int(k.value) == hash(k) for k in (RedOpType.SUM, RedOpType.MAX,
                                                                         RedOpType.BXOR, RedOpType.AVG))
    except Exception:  # noqa: BLE001 - a torch without it: read the attributes
        return False


#: ``redop_code(op)``: the int value of the kind of ``op``, a ``ReduceOp`` or a
#: ``RedOpType`` (the caller checked its class).  ``hash`` where torch makes it that
#: value (a C call: reading ``op.op.value`` costs about twice as many instructions,
#: docs/benchmarks.md), else the attributes.
redop_code = hash if _hash_is_code() else _code_by_attribute


def premul_sum_factor(op):
    """The factor of a PREMUL_SUM ReduceOp: a float or a 1-element tensor.

    torch keeps the factor in a C++ supplement; its pickling state is the only
    public door to it.
    """
    _, factor = op.__getstate__()
    return factor


def register_rendezvous_handler(scheme: str, handler) -> None:
    import importlib

    # ``from torch.distributed import rendezvous`` is a function; we need the module.
    rdzv_module = importlib.import_module("torch.distributed.rendezvous")

    if scheme not in rdzv_module._rendezvous_handlers:
        rdzv_module.register_rendezvous_handler(scheme, handler)


def distributed_available() -> bool:
    """Whether this torch was built with torch.distributed."""
    return dist.is_available()


def wrap_env_rendezvous(wrap) -> None:
    """Replace torch's ``env://`` rendezvous handler by ``wrap(torch's)``,
    once (torch offers no public way to replace a handler)."""
    import importlib

    rdzv_module = importlib.import_module("torch.distributed.rendezvous")
    handlers = rdzv_module._rendezvous_handlers
    current = handlers.get("env")
    if current is not None and not getattr(current, "hpccomm", False):
        handlers["env"] = wrap(current)


def register_backend(name: str, creator, devices) -> None:
    if name.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)


def default_store():
    """The default group's store, without any group's prefix (None before init)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def fully_shard():
    """torch's FSDP2 ``fully_shard`` (``torch.distributed.fsdp``, imported on
    first use: the example programs and benchmarks train with it)."""
    from torch.distributed.fsdp import fully_shard as shard

    return shard


def world_group():
    """torch's default (world) process group."""
    return dist.group.WORLD


def default_group_or_none():
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return None
    return c10d._get_default_group()


TCPStore = _c10d.TCPStore


def nccl_available() -> bool:
    """True when torch was built with NCCL or cupy has NCCL (either can carry
    GPU tensors); False on a CPU-only build.  Imports cupy only if installed."""
    if dist.is_nccl_available():
        return True
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - a cupy without a usable CUDA/NCCL raises various errors
        return False
    return bool(getattr(nccl, "available", True))


# --------------------------------------------------------------------------
# GPU transports (hpccomm.gpu): torch's NCCL backend and the option objects
# its methods take.
# --------------------------------------------------------------------------

PrefixStore = _c10d.PrefixStore

#: torch's option classes, by the name hpccomm._gpu.nccl_torch uses.
OPTION_CLASSES = {
    "allreduce": _c10d.AllreduceOptions,
    "allreduce_coalesced": _c10d.AllreduceCoalescedOptions,
    "reduce": _c10d.ReduceOptions,
    "reduce_scatter": _c10d.ReduceScatterOptions,
    "broadcast": _c10d.BroadcastOptions,
    "scatter": _c10d.ScatterOptions,
    "gather": _c10d.GatherOptions,
    "allgather": _c10d.AllgatherOptions,
    "alltoall": _c10d.AllToAllOptions,
}


def on_cuda_init(fn) -> None:
    """Run ``fn`` when this process first initialises CUDA (at once if it
    has): torch's queue of calls deferred to CUDA's start
    (``torch.cuda._lazy_call``, in torch since 1.x), so nothing of CUDA is
    touched before the program itself uses it."""
    import torch

    torch.cuda._lazy_call(fn)


def torch_nccl_available() -> bool:
    """Whether this torch was built with NCCL (``dist.is_nccl_available()``)."""
    return bool(dist.is_nccl_available())


def make_nccl_backend(store, rank: int, size: int, timeout=None, name: str = "", global_ranks=None):
    """torch's ``ProcessGroupNCCL`` over ``store`` (no MASTER_ADDR: the store
    is hpccomm's own), set up as torch's ``_new_process_group_helper`` sets
    it up.  NCCL's communicator itself is made by torch at the first
    collective, through the store."""
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None:
        raise RuntimeError("this torch has no NCCL (torch.distributed.is_nccl_available() is False)")
    options = pg_nccl.Options()
    options.is_high_priority_stream = False
    if timeout is not None:
        options._timeout = timeout
    if name and hasattr(options, "group_name"):
        options.group_name = name
    if global_ranks is not None and hasattr(options, "global_ranks_in_group"):
        options.global_ranks_in_group = list(global_ranks)
    return pg_nccl(store, rank, size, options)


def requested_device_backends():
    """The ``{device: backend}`` map torch is creating a group for, such as
    ``{"cpu": "hpccomm", "cuda": "nccl"}`` for ``backend="cpu:hpccomm,cuda:nccl"``,
    or None when not called from torch's group creation.

    torch 2.13 stops at the first backend that is a whole ProcessGroup (as
    hpccomm's is) and never builds the others, so hpccomm reads the map from
    torch's ``_new_process_group_helper`` frame to honour ``cuda:<backend>``.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get("backend_config") if frame.f_code.co_name == "_new_process_group_helper" else None
        if config is not None and hasattr(config, "get_device_backend_map"):
            return {str(k): str(v) for k, v in config.get_device_backend_map().items()}
        frame = frame.f_back
    return None


def requested_backend():
    """The backend string of the ``dist.init_process_group`` call running on
    this thread (``"hpccomm"``, ``"cpu:hpccomm,cuda:nccl"``, ``"gloo"`` ...),
    or None when not called from it.  For the env:// rendezvous, which torch
    runs before any backend is made and without saying for which: read from
    torch's ``init_process_group`` frame, where torch 2.13 to 2.15 hold it as
    ``backend``."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and frame.f_globals.get("__name__") == dist.__name__ + \
                ".distributed_c10d":
            backend = frame.f_locals.get("backend")
            return None if backend is None else str(backend)
        frame = frame.f_back
    return None


_hidden = []  # (class, method names) waiting for Dynamo to be imported


def hide_from_compiler(cls, names):
    """Run the methods ``names`` of ``cls`` with TorchDynamo off, from the
    moment Dynamo is imported (at once if it already is).

    torch's C++ layer calls a Python process group's methods (and its Works')
    from inside code that ``torch.compile`` is running, for example DDP's
    ``reducer._rebuild_buckets()`` broadcasting from a compiled forward.
    Dynamo then tries to compile the method's frame, where ``self`` is a
    ``ProcessGroup``, an opaque object to it since torch 2.13, and reading any
    attribute of ours is a hard error ("Attempted to access unregistered member
    on an OpaqueObject"), not a graph break.  ``torch._dynamo.disable``'s
    wrapper lives in a file Dynamo never traces; it costs about 1 us a call.
    Importing Dynamo costs about 1 s, so it is not imported for this: a
    process that never compiles keeps plain methods; ``torch.compile`` imports
    Dynamo before it can run anything, and the import hook below wraps the
    methods then.
    """
    import sys

    _hidden.append((cls, list(names)))
    if "torch._dynamo" in sys.modules and hasattr(sys.modules["torch._dynamo"], "disable"):
        _wrap_hidden()
    elif not any(isinstance(f, _DynamoImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportHook())


def _wrap_hidden() -> None:
    import torch._dynamo

    while _hidden:
        cls, names = _hidden.pop()
        for name in names:
            setattr(cls, name, torch._dynamo.disable(cls.__dict__[name], recursive=True))


class _DynamoImportHook:
    """A one-shot ``sys.meta_path`` finder: lets ``torch._dynamo`` load as
    usual, then calls :func:`_wrap_hidden`, and removes itself."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        import importlib.machinery
        import sys

        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _wrap_hidden()

        spec.loader.exec_module = exec_module
        return spec


# --------------------------------------------------------------------------
# Fault tolerance (hpccomm.fault_tolerance): torch's registry of groups, and the base
# class of hpccomm.RankFailure.
# --------------------------------------------------------------------------

DistBackendError = dist.DistBackendError


def process_groups() -> list:
    """``(group, global ranks in group-rank order)`` for every process group
    torch knows on this rank but the default one, oldest first."""
    from torch.distributed import distributed_c10d as c10d

    default = c10d._world.default_pg
    out = []
    for pg, ranks in list(c10d._world.pg_group_ranks.items()):
        if pg is default or not isinstance(pg, dist.ProcessGroup):
            continue
        out.append((pg, [g for g, _ in sorted(ranks.items(), key=lambda item: item[1])]))
    return out


def replace_group_store(pg, store) -> None:
    """Make ``store`` the store torch keeps for group ``pg`` (what
    ``dist.shrink_group`` clones for the group it makes: the old one may have
    lived on a rank that failed)."""
    from torch.distributed import distributed_c10d as c10d

    backend, _ = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = (backend, store)


def retype_shrunk_groups(is_ours) -> None:
    """Make ``dist.shrink_group`` register a shrunk hpccomm Backend as what it is.

    torch 2.14/2.15's ``_create_shrunk_process_group`` puts the new Backend
    under torch's GLOO type for CPU (it assumes gloo there), and DDP's C++
    logger then takes it for a ProcessGroupGloo: a segfault in
    ``c10d::Logger::set_env_variables`` (torch 2.15, seen here).  After
    torch made the group, a Backend ``is_ours`` accepts is registered again
    as CUSTOM, as hpccomm registers its own groups.  Installed once."""
    from torch.distributed import distributed_c10d as c10d

    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is None or getattr(create, "hpccomm", False):
        return

    def create_and_retype(new_backend, *args, **kwargs):
        pg = create(new_backend, *args, **kwargs)
        if is_ours(new_backend):
            custom = dist.ProcessGroup.BackendType.CUSTOM
            for device in ("cpu", "cuda"):
                pg._register_backend(torch.device(device), custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    create_and_retype.hpccomm = True
    c10d._create_shrunk_process_group = create_and_retype


# -- groups made by their members only -----------------------------------------

def _counter_salts_names() -> bool:
    """Whether torch salts a hashed group name (``use_local_synchronization``)
    with its per-process group counter (torch >= 2.14), which such a creation
    then advances on the members only.  Asked by trying both counters, and
    the counter put back."""
    from torch.distributed import distributed_c10d as c10d

    hash_ranks = getattr(c10d, "_hash_ranks_to_str", None)
    world = getattr(c10d, "_world", None)
    if hash_ranks is None or not hasattr(world, "group_count"):
        return False
    saved = world.group_count
    try:
        world.group_count = 0
        first = hash_ranks([0])
        world.group_count = 1
        return hash_ranks([0]) != first
    finally:
        world.group_count = saved


_members_only_made: dict = {}


class members_only_naming:
    """Around a group creation that only the group's members call (hpccomm's
    :func:`hpccomm.from_mpi4py`, Horovod-style process-set groups): on a
    torch whose hashed group names are salted with its group counter, the
    counter would advance on the members only, and the next group every rank
    makes with a default name (gloo rendezvouses by it) would get different
    names on different ranks and hang.  Inside, the counter holds a salt of
    hpccomm's own (negative: never one torch's counter reaches), counted per
    rank set, which every member computes alike (members create their groups
    in the same order, torch's rule); after, the counter is back where the
    non-members have it."""

    def __init__(self, ranks) -> None:
        self.key = tuple(sorted(ranks))

    def __enter__(self):
        from torch.distributed import distributed_c10d as c10d

        if not _salted:  # asked once, when the first such group is made (not at import)
            _salted.append(_counter_salts_names())
        if not _salted[0]:
            self.saved = None
            return self
        n = _members_only_made.get(self.key, 0) + 1
        _members_only_made[self.key] = n
        self.saved = c10d._world.group_count
        c10d._world.group_count = -n
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import distributed_c10d as c10d

        if self.saved is not None:
            c10d._world.group_count = self.saved


_salted: list = []  # [whether torch salts the names: _counter_salts_names()]
