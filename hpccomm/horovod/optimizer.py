"""``hvd.DistributedOptimizer``: gradients averaged across ranks while backward runs.

The returned object is an instance of a class made at run time that derives
from the wrapped optimizer's class (so ``isinstance(opt, torch.optim.SGD)``
holds and LR schedulers work), with Horovod's ``step``, ``zero_grad``,
``synchronize`` and ``skip_synchronize``.

How gradients travel: a hook on every parameter fires when its gradient has
been accumulated (``register_post_accumulate_grad_hook``); after
``backward_passes_per_step`` passes the parameter is ready.  Parameters are
reduced in units (``groups``, or consecutive parameters in reverse
registration order fused up to ``HOROVOD_FUSION_THRESHOLD`` bytes, 25 MiB by
default), always in the same unit order on every rank (ops are matched by
order), each unit as soon as it and every unit before it are ready, so the
reduction of late layers overlaps the backward of early ones.  The first
unit of a step is preceded by one agreement step for the whole step (see
hpccomm.horovod.ops).  ``synchronize()`` (called by ``step()``) reduces what
is left (parameters that got no gradient are reduced as zeros, as in
Horovod) and waits.
"""
from __future__ import annotations

import os
import warnings
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .. import _compat
from . import basics
from .compression import Compression
from .ops.allgather import sparse_allreduce_async
from .ops.allreduce import start_allreduce
from .ops.checks import OP_NAMES, Adasum, Average
from .ops.negotiation import OPTIMIZER, negotiate
from .process_sets import ProcessSet, global_process_set

DEFAULT_FUSION_BYTES = 25 * 1024 * 1024
ZERO_GRAD_MSG = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                 "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
TOO_MANY_PASSES_MSG = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                       "Increase backward_passes_per_step to accumulate gradients locally.")
STEP_AFTER_SYNC_MSG = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                       "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                       "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")

_reducers = weakref.WeakValueDictionary()   # key -> _GradReducer (a joined rank feeds their rounds)
_counters: dict = {}


def fusion_bytes() -> int:
    """``HOROVOD_FUSION_THRESHOLD`` (bytes; 0 turns fusion off), default 25 MiB."""
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD", "")
    if raw == "":
        return DEFAULT_FUSION_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={raw!r} is not a byte count (a non-negative integer; 0 turns "
                         "gradient fusion off)")
    return value


def _split_list(items, n):
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def parameter_names(opt, named_parameters) -> dict:
    """Horovod's ``_parameter_names``: ``{parameter: name}``, sorted by name.

    Without ``named_parameters`` the names are ``allreduce.noname.<i>.<j>``, the
    j-th parameter of param group i: the same unique names on every rank.

    :raises ValueError: ``named_parameters`` is not a sequence of ``(name,
        parameter)`` tuples, repeats a name, or leaves a parameter of ``opt`` out.
    """
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(opt.param_groups)
                            for j, p in enumerate(g["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    names = [k for k, _ in named_parameters]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                         % ", ".join(dups))
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [id(p) for g in opt.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: %s" % ", ".join(str(i) for i in unnamed))
    return {p: k for k, p in sorted(named_parameters, key=lambda kp: kp[0])}


class _GradReducer:
    """The reduction state of one DistributedOptimizer."""

    def __init__(self, opt, compression, passes, op, predivide, groups, sparse_as_dense, ps: ProcessSet) -> None:
        if groups is not None:
            if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
                raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
            if isinstance(groups, list):
                seen = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in seen:
                            raise ValueError("A parameter can only appear once in groups.")
                        seen.add(id(p))
        self.opt = weakref.proxy(opt)  # its _parameter_names name the sparse reductions, as in Horovod
        self.compression = compression
        self.passes = passes
        self.op = op
        self.predivide = predivide
        self.sparse_as_dense = sparse_as_dense
        self.ps = ps
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        self.units = self._units(params, groups)
        self.unit_of = {id(p): i for i, unit in enumerate(self.units) for p in unit}
        self.delay = {id(p): passes for p in params}
        self.ready: set = set()
        self.next_unit = 0
        self.round_open = False
        self.pending: dict = {}
        self.touched = False
        self.synchronized = False
        self.should_synchronize = True
        self.hooks = []
        self.group = None
        self.key = None
        self._desc = None
        if ps.included():
            index = _counters.get(ps.process_set_id, 0)
            _counters[ps.process_set_id] = index + 1
            self.key = (ps.process_set_id, index)
            _reducers[self.key] = self
            # the optimizer's own communicator: a joined rank can queue this step's zero-filled
            # reductions on it while it takes part in other ops on the process set's groups
            with _compat.members_only_naming(ps.ranks):  # torch's group counter as the non-members have it
                self.group = dist.new_group(ps.ranks, use_local_synchronization=True)
            if basics.size() > 1:
                for p in params:
                    self.hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    # -- layout -------------------------------------------------------------------------
    def _wire_dtype(self, p):
        return self.compression.compress(torch.empty(0, dtype=p.dtype))[0].dtype

    def _units(self, params, groups):
        order = list(reversed(params))  # roughly the order backward produces gradients
        rank_in_order = {id(p): i for i, p in enumerate(order)}
        if groups is None:
            limit = fusion_bytes()
            units, current, used = [], [], 0
            for p in order:
                nbytes = p.numel() * p.element_size()
                fits = current and used + nbytes <= limit and self._wire_dtype(p) == self._wire_dtype(current[0]) \
                    and p.device == current[0].device
                if current and not fits:
                    units.append(current)
                    current, used = [], 0
                current.append(p)
                used += nbytes
            if current:
                units.append(current)
            return units
        if isinstance(groups, int):
            chosen = _split_list(params, groups)
        else:
            wanted = {id(p) for p in params}
            chosen = [[p for p in g if id(p) in wanted] for g in groups]
            grouped = {id(p) for g in chosen for p in g}
            chosen += [[p] for p in params if id(p) not in grouped]
        chosen = [g for g in chosen if g]
        return sorted(chosen, key=lambda g: min(rank_in_order[id(p)] for p in g))

    def _round_desc(self):
        if self._desc is None:
            tensors = tuple((str(self._wire_dtype(p)).replace("torch.", ""), tuple(p.shape), p.device.type)
                            for unit in self.units for p in unit)
            pre, post = self._scales()
            self._desc = (OPTIMIZER, f"DistributedOptimizer#{self.key[1]}",
                          (("op", OP_NAMES.get(self.op, self.op)), ("prescale_factor", pre),
                           ("postscale_factor", post), ("units", tuple(len(u) for u in self.units)),
                           ("key", self.key)), tensors)
        return self._desc

    def _scales(self):
        if self.op == Average:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0

    # -- the backward hooks --------------------------------------------------------------------
    def _hook(self, p) -> None:
        pid = id(p)
        if self.delay[pid] <= 0:
            raise AssertionError(TOO_MANY_PASSES_MSG)
        self.touched = True
        self.delay[pid] -= 1
        if self.delay[pid] == 0:
            self.ready.add(pid)
            while self.next_unit < len(self.units) and all(id(q) in self.ready for q in self.units[self.next_unit]):
                self._issue(self.next_unit)
                self.next_unit += 1

    def _issue(self, i: int) -> None:
        basics.require_init()
        if self.group is None:
            raise ValueError("hpccomm.horovod DistributedOptimizer: this optimizer was made before hvd.shutdown(); "
                             "wrap the optimizer again after hvd.init()")
        if not self.round_open:
            negotiate(self.ps, self._round_desc())
            self.round_open = True
        pre, post = self._scales()
        wire, back, sparse = [], [], []
        for p in self.units[i]:
            if p.grad is None:  # no gradient on this rank this step; others may have one
                p.grad = torch.zeros_like(p)
            g = p.grad
            if g.is_sparse:
                if not self.sparse_as_dense:
                    sparse.append((p, sparse_allreduce_async(g, self.opt._parameter_names[p], self.op, self.ps)))
                    continue
                g = g.to_dense()
            compressed, ctx = self.compression.compress(g)
            wire.append(compressed)
            back.append((p, ctx))
        pending = start_allreduce(self.ps, wire, self.op, pre, post, group=self.group) if wire else None
        self.pending[i] = (pending, back, sparse)

    # -- step ------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        if not self.ps.included():
            self.synchronized = True
            return
        while self.next_unit < len(self.units):
            self._issue(self.next_unit)
            self.next_unit += 1
        for i in sorted(self.pending):
            pending, back, sparse = self.pending[i]
            outputs = pending.wait() if pending is not None else []
            for (p, ctx), out in zip(back, outputs):
                result = self.compression.decompress(out, ctx)
                if p.grad.is_sparse:
                    p.grad.zero_().add_(result.to_sparse())
                elif result is not p.grad:
                    p.grad.copy_(result)
            for p, finish in sparse:
                p.grad.zero_().add_(finish())
        self._new_round()
        self.synchronized = True

    def reset(self) -> None:
        """At load_state_dict: forget this step's reductions (as Horovod does; a
        sparse reduction's names are freed, its transfer still completes)."""
        for _, _, sparse in self.pending.values():
            for _, finish in sparse:
                finish.discard()
        self._new_round()
        self.synchronized = False
        self.should_synchronize = True

    def _new_round(self) -> None:
        """Nothing issued or ready, every parameter ``passes`` backward passes away from its reduction."""
        self.pending.clear()
        self.ready.clear()
        for pid in self.delay:
            self.delay[pid] = self.passes
        self.next_unit = 0
        self.round_open = False
        self.touched = False

    def feed(self, device):
        """As a joined rank: this step's reductions with zeros (started, not waited)."""
        pre, post = self._scales()
        out = []
        for unit in self.units:
            zeros = [torch.zeros(p.shape, dtype=self._wire_dtype(p), device=device) for p in unit]
            out.append(start_allreduce(self.ps, zeros, self.op, pre, post, group=self.group))
        return out


def teardown() -> None:
    """At hvd.shutdown(): free every DistributedOptimizer's communicator; their
    hooks then do nothing until the next init."""
    for reducer in list(_reducers.values()):
        if reducer.group is not None and dist.is_initialized():
            dist.destroy_process_group(reducer.group)
        reducer.group = None
        for hook in reducer.hooks:
            hook.remove()
        reducer.hooks.clear()
    _reducers.clear()
    _counters.clear()


def feed_round(desc, device):
    key = dict(desc[2])["key"]
    reducer = _reducers.get(tuple(key))
    if reducer is None:
        raise RuntimeError(f"hpccomm.horovod join: the other ranks reduce gradients of DistributedOptimizer {key}, "
                           "which this rank does not have; create the same optimizers on every rank")
    return reducer.feed(device)


class _DistributedMixin:
    """Horovod's methods, put in front of the wrapped optimizer's class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                 groups, sparse_as_dense, process_set):
        super().__init__(params)
        #: Horovod's table of parameter names, ``{parameter: name}`` sorted by name (scripts and tests read it)
        self._parameter_names = parameter_names(self, named_parameters)
        self._hvd = _GradReducer(self, compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
                                 sparse_as_dense, process_set)

    @property
    def backward_passes_per_step(self) -> int:
        return self._hvd.passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate before a reduction."""
        self._hvd.passes = passes
        for pid in self._hvd.delay:
            self._hvd.delay[pid] = passes

    def synchronize(self) -> None:
        """Finish reducing every gradient now (for gradient clipping, AMP
        unscaling, ...); then call ``step()`` inside :meth:`skip_synchronize`."""
        self._hvd.synchronize()

    @contextmanager
    def skip_synchronize(self):
        """``with optimizer.skip_synchronize(): optimizer.step()`` steps without reducing again."""
        self._hvd.should_synchronize = False
        try:
            yield
        finally:
            self._hvd.should_synchronize = True

    def step(self, closure=None):
        if self._hvd.should_synchronize:
            if self._hvd.synchronized:
                warnings.warn(STEP_AFTER_SYNC_MSG)
            self._hvd.synchronize()
        self._hvd.synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd.touched:
            raise AssertionError(ZERO_GRAD_MSG)
        return super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict):
        self._hvd.reset()
        return super().load_state_dict(state_dict)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (or
    summed) across the ranks of ``process_set``, reduced while backward runs.

    :param optimizer: a ``torch.optim.Optimizer``.
    :param named_parameters: ``model.named_parameters()`` (names in errors); default: generated names.
    :param compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``.
    :param backward_passes_per_step: backward passes accumulated locally before each reduction.
    :param op: ``hvd.Average`` (default) or ``hvd.Sum`` (``hvd.Min``/``Max``/``Product`` too).
    :param gradient_predivide_factor: with Average: gradients are scaled by
        1/factor before the sum and factor/size after.
    :param num_groups: deprecated (Horovod's); use ``groups``.
    :param groups: an int (that many groups of parameters, each reduced as one
        op) or a list of lists of parameters; default: automatic fusion.
    :param sparse_as_dense: reduce sparse gradients as dense tensors.
    :param process_set: the :class:`ProcessSet` whose ranks average their gradients.
    :raises ValueError: ``backward_passes_per_step`` < 1; a predivide factor
        with op other than Average; malformed ``named_parameters`` or ``groups``;
        a malformed ``HOROVOD_FUSION_THRESHOLD``.
    :raises NotImplementedError: ``op=hvd.Adasum``.

    ``step()`` raises :class:`HorovodInternalError` when the ranks' models
    differ; ``zero_grad()`` between ``backward()`` and ``step()`` and more
    backward passes than ``backward_passes_per_step`` raise AssertionError, as
    in Horovod.

    Example::

        opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loss.backward(); opt.step()
    """
    basics.require_init()
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError("hpccomm.horovod DistributedOptimizer: op=hvd.Adasum is not supported (hpccomm.horovod "
                                  "has no Adasum reduction); use op=hvd.Average, the default")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)
