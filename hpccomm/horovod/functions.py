"""Model and optimizer state helpers: broadcast_parameters,
broadcast_optimizer_state, broadcast_object, allgather_object."""
from __future__ import annotations

import collections
import io
import pickle

import torch

from . import basics
from .optimizer import _DistributedMixin
from .ops.allgather import allgather
from .ops.broadcast import broadcast_, broadcast_handle
from .ops.handles import inline, synchronize
from .process_sets import global_process_set


def broadcast_parameters(params, root_rank) -> None:
    """Overwrite parameters on every rank with ``root_rank``'s, in place.

    One agreement step checks that every rank passes the same names, dtypes
    and shapes (a model that differs between ranks is an error naming the
    first difference), then every tensor is broadcast.

    :param params: a dict (``model.state_dict()``; sorted by name, as Horovod
        does) or a list of tensors or ``(name, tensor)`` pairs
        (``model.parameters()``, ``model.named_parameters()``).
    :param root_rank: the global rank whose values win.
    :raises ValueError: ``params`` is of another type, or a bad root rank.
    :raises HorovodInternalError: the ranks' parameters do not match.

    Example::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("invalid params of type: %s" % type(params))
    if not items:
        return
    tensors = [p for _, p in items]
    with torch.no_grad(), inline():
        synchronize(broadcast_handle("broadcast", tensors, root_rank, "broadcast_parameters", global_process_set,
                                      in_place=True, grouped=True))


def broadcast_optimizer_state(optimizer, root_rank, model=None) -> None:
    """Overwrite the optimizer's state and hyper-parameters (learning rate,
    momentum, ...) on every rank with ``root_rank``'s.

    An optimizer that has not stepped yet gets its state made first, by one
    step with zero gradients (as Horovod does; the model's gradients are left
    at zero). Tensors are broadcast in place; other values (and the
    param_groups' options) as pickled objects.

    :param optimizer: a ``torch.optim.Optimizer`` or an :func:`DistributedOptimizer`.
    :param root_rank: the global rank whose state wins.
    :param model: optional; its ``nn.Embedding(sparse=True)`` parameters get
        sparse zero gradients for that first step.
    :raises ValueError: ``torch.optim.LBFGS`` (its state cannot be broadcast
        this way, as in Horovod), or a bad root rank.
    :raises HorovodInternalError: the ranks' optimizer states do not match.

    Example::

        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        sparse = set()
        if model is not None:
            for m in model.modules():
                if isinstance(m, torch.nn.Embedding) and m.sparse:
                    sparse.update(id(p) for p in m.parameters())
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        if isinstance(optimizer, _DistributedMixin):
            super(_DistributedMixin, optimizer).step()  # the wrapped optimizer's step: no reduction
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return  # a stateless optimizer
    tensors = []
    scalars = {}
    setters = {}
    seen = collections.defaultdict(int)

    def set_option(index, key):
        def assign(value):
            optimizer.param_groups[index][key] = value
        return assign

    def set_state(pid, key):
        def assign(value):
            state_dict["state"][pid][key] = value
        return assign

    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key == "params":
                continue
            scalars[f"{key}.{index}"] = value
            setters[f"{key}.{index}"] = set_option(index, key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for key, value in state_dict["state"][pid].items():
                seen[key] += 1
                unique = f"{key}.{seen[key]}"
                if torch.is_tensor(value):
                    tensors.append((unique, value))
                else:
                    scalars[unique] = value
                    setters[unique] = set_state(pid, key)
    broadcast_parameters(tensors, root_rank)
    for key, value in broadcast_object(scalars, root_rank).items():
        setters[key](value)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank of the set (pickled, then broadcast).

    :param obj: any picklable object (on ranks other than the root it is ignored).
    :param root_rank: the global rank that sends.
    :param name: a name (default: the object's type name).
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: a bad root rank, or this rank is not in the set.
    :raises pickle.PicklingError: the root's object cannot be pickled.

    Uses :mod:`pickle` (Horovod used cloudpickle: lambdas and local classes do not travel here).

    Example::

        config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)
    """
    if name is None:
        name = type(obj).__name__
    if basics.rank() == root_rank:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        broadcast_(length, root_rank, name + ".sz", process_set)
    else:
        length = torch.zeros(1, dtype=torch.int64)
        broadcast_(length, root_rank, name + ".sz", process_set)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name + ".t", process_set)
    if basics.rank() == root_rank:
        return obj
    return pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None) -> list:
    """Every rank's ``obj``, in rank order (pickled, then allgathered).

    :param obj: any picklable object.
    :param name: a name (default: the object's type name).
    :raises ValueError: Horovod is not initialised.
    :raises pickle.PicklingError: ``obj`` cannot be pickled.

    Example::

        hosts = hvd.allgather_object(socket.gethostname())
    """
    if name is None:
        name = type(obj).__name__
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=name + ".sz").tolist()
    gathered = allgather(data, name=name + ".t").numpy().tobytes()
    out, start = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[start:start + n]))
        start += n
    return out
