"""A CPU harness that holds the GPU contracts: a fake CUDA device whose
unsynchronised host reads see stale data, and a fake NCCL that refuses what
NCCL refuses.  The GPU transports run against them, for real over MPI, at
1-4 ranks (tests/test_gpu_contracts.py), so CI catches a missing
synchronisation or a call NCCL would refuse without a GPU.

The device (:class:`FakeDevice`, one per process: :data:`DEVICE`)
---------------------------------------------------------------------
A :class:`StaleCudaTensor` is a CPU tensor that says it lives on cuda:0.
Its memory (what ``data_ptr()`` gives, what MPI reads and writes) is the
*host-visible* state.  Every torch op on such tensors is a kernel on one
stream: it runs at once, but its writes land in a shadow copy of the storage,
which later kernels see and the memory does not, until the stream is
synchronised as far as that kernel (:meth:`FakeDevice.flush`: ``CudaStreams.wait``
for an event recorded after it, ``synchronize``; the streams object the
transports take).  A tensor a kernel creates holds garbage in memory until then.  So MPI handed memory that a
kernel of the op wrote, without a synchronisation between, sends stale data,
and the peers' results are wrong: the harness fails.  A copy to a host
tensor reads the device's current values (a blocking device-to-host copy
waits for the stream); with ``non_blocking=True`` it lands at the next
synchronisation that reaches it.  One stream: an event is the number of
the last kernel queued when it was recorded, and waiting for it brings the
writes of exactly the kernels before it to memory (a transport that waits
for an event recorded before the kernel MPI reads is caught).

NCCL (:class:`FakeNCCL`)
------------------------
Takes the calls ``hpccomm._gpu.nccl_torch`` makes on torch's
``ProcessGroupNCCL`` (the same method names and option objects) and refuses,
as torch's NCCL group does (torch 2.13-2.15 ``ProcessGroupNCCL.cpp``,
``NCCLUtils``): non-contiguous tensors ("Tensors must be contiguous"), dtypes
without an NCCL type (int16, uint16/32/64, complex: "Unconvertible NCCL type"),
the bitwise ReduceOps ("Cannot use ReduceOp.BAND with NCCL"), AVG of bools,
PREMUL_SUM of non-float types, receiving from any source, tensors of two
devices in one call, and two ranks on one GPU (at the first op, as NCCL's
communicator set-up: "Duplicate GPU detected").  What it accepts it runs in
stream order on the device's values (reads see pending kernels, writes are
kernels), exchanging the data over MPI on a duplicate of the group's
communicator.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from hpccomm._compat import premul_sum_factor
from helpers import FakeCudaTensor

_R = dist.ReduceOp.RedOpType
CUDA0 = torch.device("cuda", 0)

#: Tensor methods and functions that only read a tensor's metadata or memory
#: address: they run on the memory, never on device values.
_META = {
    "data_ptr", "is_contiguous", "stride", "size", "numel", "element_size", "dim", "storage_offset",
    "untyped_storage", "nbytes", "itemsize", "__len__", "is_complex", "is_floating_point", "is_signed",
    "_is_view", "is_pinned", "is_sparse", "layout", "requires_grad", "get_device", "_typed_storage",
    "nelement", "ndimension", "__hash__", "__repr__", "__format__", "__str__", "__reduce_ex__",
}


#: Functions that allocate without computing (no kernel: nothing pending on the new memory).
_ALLOCATIONS = {"new_empty", "empty_like", "new_empty_strided", "empty", "empty_strided"}


class StaleCudaTensor(FakeCudaTensor):
    """A CPU tensor claiming to live on cuda:0 (helpers.FakeCudaTensor); its
    host-visible memory goes stale under pending kernels (see the module
    docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return DEVICE.run(func, args, kwargs or {})


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def _key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


def _over(storage_tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype, shape, strides and offset over ``storage_tensor``'s storage."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.empty(0, dtype=like.dtype).set_(storage_tensor.untyped_storage(), like.storage_offset(),
                                                     like.shape, like.stride())


class FakeDevice:
    """See the module docstring.  ``flushes`` counts synchronisations."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._shadows: dict = {}  # storage address -> (memory bytes, shadow bytes): the device's current values
        # what reaches memory when the stream gets there, in order: (kernel number, storage address, memory bytes,
        # snapshot of the storage after that kernel), or (kernel number, None, host tensor, value) for a
        # non_blocking device-to-host copy
        self._pending: list = []
        self.flushes = 0
        self.kernels = 0

    # -- making and reading tensors --------------------------------------------
    def tensor(self, t: torch.Tensor) -> StaleCudaTensor:
        """A device tensor holding ``t``'s values (copied; in sync with memory)."""
        return _plain(t).clone().as_subclass(StaleCudaTensor)

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """A plain CPU copy of ``t``'s current device values (what a kernel or a blocking ``.cpu()`` sees)."""
        with self._lock, torch._C.DisableTorchFunctionSubclass():
            return self._device_view(t).clone()

    def memory(self, t: torch.Tensor) -> torch.Tensor:
        """A plain CPU copy of ``t``'s host-visible memory (what MPI reads now)."""
        with torch._C.DisableTorchFunctionSubclass():
            return _plain(t).clone()

    # -- the stream ----------------------------------------------------------
    def flush(self, upto=None) -> None:
        """The stream reached kernel ``upto`` (an event: :meth:`record`), or
        everything queued (``None``): those kernels' writes reach memory."""
        with self._lock, torch._C.DisableTorchFunctionSubclass():
            keep = []
            for entry in self._pending:
                number, key, target, value = entry
                if upto is not None and number > upto:
                    keep.append(entry)
                    continue
                target.copy_(value)
            self._pending = keep
            still = {e[1] for e in keep}
            for key in [k for k in self._shadows if k not in still]:
                del self._shadows[key]
            self.flushes += 1

    def record(self) -> int:
        """An event: the number of the last kernel queued so far."""
        return self.kernels

    def dirty(self) -> int:
        """How many storages hold writes that memory does not show yet."""
        return len({e[1] for e in self._pending if e[1] is not None})

    def _device_view(self, t: torch.Tensor) -> torch.Tensor:
        entry = self._shadows.get(_key(t))
        return _plain(t) if entry is None else _over(entry[1], t)

    def _writable(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        entry = self._shadows.get(key)
        if entry is None:
            with torch._C.DisableTorchFunctionSubclass():
                memory = torch.empty(0, dtype=torch.uint8).set_(_plain(t).untyped_storage())
                entry = self._shadows[key] = (memory, memory.clone())
        return _over(entry[1], t)

    # -- kernels ---------------------------------------------------------------
    def run(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        if name in _META:
            return _call_plain(func, args, kwargs)
        if name == "__get__":  # a property: metadata, or a view (.T, .real, .mT)
            result = _call_plain(func, args, kwargs)
            return self._wrap_views(result, args)
        with self._lock:
            self.kernels += 1
            writes_self = (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
            out = kwargs.get("out")
            targets = []
            if writes_self and args and isinstance(args[0], StaleCudaTensor):
                targets.append(args[0])
            for o in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(o, StaleCudaTensor):
                    targets.append(o)
            if name == "copy_" and args and not isinstance(args[0], StaleCudaTensor) and \
                    isinstance(args[1], StaleCudaTensor):
                return self._to_host(args[0], args[1], kwargs)
            mapped = {id(t): self._writable(t) for t in targets}

            def dev(x):
                if isinstance(x, StaleCudaTensor):
                    return mapped.get(id(x)) if id(x) in mapped else self._device_view(x)
                if isinstance(x, (list, tuple)):
                    return type(x)(dev(y) for y in x)
                return x

            with torch._C.DisableTorchFunctionSubclass():
                result = func(*dev(list(args)), **{k: dev(v) for k, v in kwargs.items()})
                for key in {_key(t) for t in targets}:
                    memory, shadow = self._shadows[key]
                    self._pending.append((self.kernels, key, memory, shadow.clone()))
            return self._result(result, args, kwargs, targets, mapped, name)

    def _to_host(self, host, src, kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            value = self._device_view(src).clone()
            if kwargs.get("non_blocking"):
                self.kernels += 1
                self._pending.append((self.kernels, None, host, value))
            else:
                host.copy_(value)
        return host

    def _result(self, result, args, kwargs, targets, mapped, name):
        if isinstance(result, (list, tuple)):
            return type(result)(self._result(r, args, kwargs, targets, mapped, name) for r in result)
        if not isinstance(result, torch.Tensor):
            return result
        if name in ("cpu", "numpy") or name == "to" and _to_host(args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return result.clone()  # a blocking copy to the host: the device's current values
        for t in targets:  # an in-place op or out=: the user's tensor itself
            if result is mapped[id(t)]:
                return t
        # a view of an argument's storage: the same view over the argument's memory
        for a in _tensor_args(args, kwargs):
            if not isinstance(a, StaleCudaTensor):
                continue
            if _key(result) == _key(self._device_view(a)):
                with torch._C.DisableTorchFunctionSubclass():
                    return _over(torch.empty(0, dtype=torch.uint8).set_(_plain(a).untyped_storage()),
                                 result).as_subclass(StaleCudaTensor)
        # a new tensor: an allocation is no kernel (its memory is as it is); a kernel's result is garbage in
        # memory until the stream is synchronised
        with torch._C.DisableTorchFunctionSubclass():
            fresh = torch.empty(result.shape, dtype=result.dtype)
            raw = torch.empty(0, dtype=torch.uint8).set_(fresh.untyped_storage())
            raw.fill_(0xA5)
            if name in _ALLOCATIONS:
                return fresh.as_subclass(StaleCudaTensor)
            shadow = raw.clone()
            _over(shadow, fresh).copy_(result)
            made = fresh.as_subclass(StaleCudaTensor)
            self._shadows[_key(made)] = (raw, shadow)
            self._pending.append((self.kernels, _key(made), raw, shadow.clone()))
        return made

    def _wrap_views(self, result, args):
        if isinstance(result, torch.Tensor) and args and isinstance(args[0], StaleCudaTensor) and \
                _key(result) == _key(args[0]):
            return result.as_subclass(StaleCudaTensor)
        return result


def _to_host(args, kwargs) -> bool:
    """Whether a ``.to(...)`` call names the host (it then returns a host tensor)."""
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _tensor_args(args, kwargs):
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (y for y in x if isinstance(y, torch.Tensor))


def _call_plain(func, args, kwargs):
    def plain(x):
        if isinstance(x, StaleCudaTensor):
            return _plain(x)
        if isinstance(x, (list, tuple)):
            return type(x)(plain(y) for y in x)
        return x

    with torch._C.DisableTorchFunctionSubclass():
        return func(*plain(list(args)), **{k: plain(v) for k, v in kwargs.items()})


DEVICE = FakeDevice()


def _let_distributed_calls_through() -> None:
    """torch.distributed's functions hand a call with a tensor subclass to the
    subclass's ``__torch_function__``; a fake device tensor goes to hpccomm as
    a CUDA tensor goes to its backend, so those calls skip that hand-over for
    StaleCudaTensor arguments (and only for them)."""
    from torch.distributed import distributed_c10d as c10d

    original = c10d.has_torch_function
    if getattr(original, "_lets_stale_through", False):
        return

    def has_torch_function(args) -> bool:
        if any(isinstance(a, StaleCudaTensor) for a in _flat(args)):
            return False
        return original(args)

    has_torch_function._lets_stale_through = True
    c10d.has_torch_function = has_torch_function


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


_let_distributed_calls_through()


def _capability_of_the_fake() -> None:
    """torch.distributed asks a CUDA tensor's device for its compute capability
    (broadcast: FP8 support); without CUDA, the fake device answers sm90."""
    original = torch.cuda.get_device_capability
    if getattr(original, "_fake", False) or torch.cuda.is_available():
        return

    def get_device_capability(device=None):
        return (9, 0)

    get_device_capability._fake = True
    torch.cuda.get_device_capability = get_device_capability


_capability_of_the_fake()


class FakeStreams:
    """The streams object the transports take (``record``, ``wait``,
    ``synchronize``) over :data:`DEVICE`; ``log`` records the calls."""

    def __init__(self, device: FakeDevice = None) -> None:
        self.device = device or DEVICE
        self.log: list = []

    def record(self, device):
        self.log.append("record")
        return self.device.record()

    def wait(self, event) -> None:
        self.log.append("wait")
        self.device.flush(event)

    def synchronize(self, device) -> None:
        self.log.append("synchronize")
        self.device.flush()

    def copy_async(self, dst, src, after=None, back: bool = False):
        """A copy on a side stream: ordered after every earlier kernel (one stream here), its event returned."""
        self.log.append("copy-back" if back else "copy-in")
        dst.copy_(src, non_blocking=True)
        return self.device.record()


def fake_pinned(nbytes: int) -> torch.Tensor:
    """Host buffers for the staged transport (plain memory: no GPU to pin for)."""
    return torch.empty(nbytes, dtype=torch.uint8)


# --------------------------------------------------------------------------
# NCCL
# --------------------------------------------------------------------------

#: torch's NCCL dtype map (ProcessGroupNCCL: getNcclDataType): anything else is refused.
NCCL_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64,
               torch.bfloat16, torch.bool}


class NcclRefused(RuntimeError):
    """What torch's NCCL process group raises for a call NCCL cannot take."""


class FakeWork:
    """NCCL's Work: the op ran in stream order at issue; ``wait`` makes the
    current stream wait (nothing to do on one stream)."""

    def __init__(self, outputs) -> None:
        self.outputs = outputs
        self.waited = 0

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        return True

    def result(self):
        return self.outputs


class FakeNCCL:
    """A fake of torch's ``ProcessGroupNCCL`` for ``rank`` of ``size`` on
    the communicator ``comm`` (a duplicate: NCCL's own channel); ``gpu`` is
    this rank's ``(node, GPU)`` and ``calls`` records ``(method, dtypes)``."""

    def __init__(self, comm, rank: int, size: int, gpu: tuple, device: FakeDevice = None) -> None:
        self.comm, self._rank, self._size, self.gpu = comm, rank, size, gpu
        self.device = device or DEVICE
        self.calls: list = []
        self._checked = False

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- the contract ------------------------------------------------------------
    def _communicator(self) -> None:
        if not self._checked:
            gpus = self.comm.allgather(self.gpu)
            for r, g in enumerate(gpus):
                if g == self.gpu and r != self._rank:
                    raise NcclRefused(f"NCCL error: invalid usage ... Duplicate GPU detected : rank {self._rank} "
                                      f"and rank {r} both on CUDA device {g[1]}")
            self._checked = True

    def _check(self, method: str, tensors, redop=None) -> None:
        tensors = list(tensors)
        self.calls.append((method, tuple(t.dtype for t in tensors)))
        for t in tensors:
            if not isinstance(t, StaleCudaTensor):
                raise NcclRefused(f"{method}: Tensors must be CUDA and dense")
            if not t.is_contiguous():
                raise NcclRefused(f"{method}: Tensors must be contiguous")
            if t.dtype not in NCCL_DTYPES:
                name = {torch.int16: "Short", torch.complex64: "ComplexFloat"}.get(t.dtype, str(t.dtype))
                raise NcclRefused(f"Unconvertible NCCL type {name}")
        if redop is not None:
            kind = redop if isinstance(redop, _R) else redop.op
            if kind in (_R.BAND, _R.BOR, _R.BXOR):
                raise NcclRefused(f"Cannot use ReduceOp.{kind.name} with NCCL")
            if kind == _R.AVG and any(t.dtype == torch.bool for t in tensors):
                raise NcclRefused("Cannot use ReduceOp.AVG with boolean inputs")
            if kind == _R.PREMUL_SUM and any(not t.dtype.is_floating_point for t in tensors):
                raise NcclRefused("PreMulSum Data type must be half, float, bfloat16 or double")
            # Two PREMUL_SUM calls real NCCL takes and answers wrongly, without an error (seen on an H200, torch
            # 2.11 + NCCL 2.28.9, 2026-11-28; docs/gpu.md "Verified where"): refused here, so a route that hands
            # NCCL either fails a CPU test.  bfloat16: torch's ProcessGroupNCCL passes a host factor to NCCL as a
            # 4-byte float where NCCL reads 2 bytes (a power of two reads as zero: all zeros; pytorch#190745)
            # and refuses a bfloat16 device factor.  A one-rank communicator: the reduce_scatter forms returned
            # the unscaled sum (the factor dropped).
            if kind == _R.PREMUL_SUM and any(t.dtype == torch.bfloat16 for t in tensors):
                raise NcclRefused(f"{method}: bfloat16 PREMUL_SUM (torch's NCCL group reads its factor wrongly: "
                                  "pytorch#190745)")
            if kind == _R.PREMUL_SUM and self._size == 1:
                raise NcclRefused(f"{method}: PREMUL_SUM in a one-rank communicator (NCCL drops the factor)")
        self._communicator()

    # -- running -----------------------------------------------------------------
    def _values(self, ts):
        return [self.device.value(t) for t in ts]

    def _write(self, t, value) -> None:
        t.copy_(value.to(t.dtype))  # a kernel: lands in the device's values, not in memory

    def _reduce(self, values, redop, dtype):
        kind = redop if isinstance(redop, _R) else redop.op
        if dtype == torch.bool and kind == _R.SUM:
            kind = _R.MAX
        if kind == _R.PREMUL_SUM:
            factor = premul_sum_factor(redop)
            if isinstance(factor, torch.Tensor):
                factor = self.device.value(factor) if isinstance(factor, StaleCudaTensor) else factor
                factor = factor.to(dtype).reshape(())
            values = [v * factor for v in values]
            kind = _R.SUM
        acc = values[0].clone()
        for v in values[1:]:
            if kind in (_R.SUM, _R.AVG):
                acc = acc + v if dtype != torch.bool else torch.logical_or(acc, v)
            elif kind == _R.PRODUCT:
                acc = acc * v if dtype != torch.bool else torch.logical_and(acc, v)
            elif kind == _R.MIN:
                acc = torch.minimum(acc, v)
            elif kind == _R.MAX:
                acc = torch.maximum(acc, v)
        if kind == _R.AVG:
            acc = acc / self._size
        return acc.to(dtype)

    def allreduce(self, tensors, opts):
        self._check("allreduce", tensors, opts.reduceOp)
        for t in tensors:
            everyone = self.comm.allgather(self.device.value(t))
            self._write(t, self._reduce(everyone, opts.reduceOp, t.dtype))
        return FakeWork(tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        self._check("reduce", tensors, opts.reduceOp)
        t = tensors[0]
        everyone = self.comm.allgather(self.device.value(t))
        if self._rank == opts.rootRank:
            self._write(t, self._reduce(everyone, opts.reduceOp, t.dtype))
        return FakeWork(tensors)

    def broadcast(self, tensors, opts):
        self._check("broadcast", tensors)
        t = tensors[0]
        value = self.comm.bcast(self.device.value(t) if self._rank == opts.rootRank else None, root=opts.rootRank)
        self._write(t, value.view(t.shape))
        return FakeWork(tensors)

    def _allgather_base(self, output, input, opts):
        self._check("_allgather_base", [output, input])
        if output.numel() != input.numel() * self._size:
            raise NcclRefused("output tensor size must be equal to world_size times input tensor size")
        everyone = self.comm.allgather(self.device.value(input).reshape(-1))
        self._write(output, torch.cat(everyone).view(output.shape))
        return FakeWork([output])

    def allgather(self, output_lists, inputs, opts):
        self._check("allgather", [*inputs, *(t for ts in output_lists for t in ts)])
        everyone = self.comm.allgather(self.device.value(inputs[0]))
        for out, value in zip(output_lists[0], everyone):
            if out.numel() != value.numel():
                raise NcclRefused("allgather: output and input sizes differ")
            self._write(out, value.view(out.shape))
        return FakeWork(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts):
        self._check("allgather_coalesced", [*inputs, *(t for ts in output_lists for t in ts)])
        for i, inp in enumerate(inputs):
            everyone = self.comm.allgather(self.device.value(inp))
            for r, value in enumerate(everyone):
                self._write(output_lists[r][i], value.view(output_lists[r][i].shape))
        return FakeWork(output_lists)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i, opts)
        return FakeWork(outputs)

    def _reduce_scatter_base(self, output, input, opts):
        self._check("_reduce_scatter_base", [output, input], opts.reduceOp)
        everyone = self.comm.allgather(self.device.value(input).reshape(-1))
        total = self._reduce(everyone, opts.reduceOp, input.dtype)
        n = output.numel()
        self._write(output, total[self._rank * n:(self._rank + 1) * n].view(output.shape))
        return FakeWork([output])

    def reduce_scatter(self, outputs, input_lists, opts):
        self._check("reduce_scatter", [*outputs, *input_lists[0]], opts.reduceOp)
        mine = [self.device.value(t) for t in input_lists[0]]
        everyone = self.comm.allgather(mine)
        total = self._reduce([e[self._rank] for e in everyone], opts.reduceOp, outputs[0].dtype)
        self._write(outputs[0], total.view(outputs[0].shape))
        return FakeWork(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return FakeWork(outputs)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        self._check("alltoall_base", [output, input])
        rows_in = input_splits or [input.shape[0] // self._size] * self._size
        rows_out = output_splits or [output.shape[0] // self._size] * self._size
        parts = list(torch.split(self.device.value(input), rows_in))
        got = self.comm.alltoall(parts)
        if [g.shape[0] for g in got] != list(rows_out):
            raise NcclRefused("alltoall_base: split sizes do not match")
        self._write(output, torch.cat(got).view(output.shape))
        return FakeWork([output])

    def alltoall(self, outputs, inputs, opts):
        self._check("alltoall", [*outputs, *inputs])
        got = self.comm.alltoall(self._values(inputs))
        for o, v in zip(outputs, got):
            self._write(o, v.view(o.shape))
        return FakeWork(outputs)

    def gather(self, output_lists, inputs, opts):
        self._check("gather", [*inputs, *(t for ts in output_lists for t in ts)])
        got = self.comm.gather(self.device.value(inputs[0]), root=opts.rootRank)
        if self._rank == opts.rootRank:
            for o, v in zip(output_lists[0], got):
                self._write(o, v.view(o.shape))
        return FakeWork(output_lists)

    def scatter(self, outputs, input_lists, opts):
        self._check("scatter", [*outputs, *(t for ts in input_lists for t in ts)])
        parts = self._values(input_lists[0]) if self._rank == opts.rootRank else None
        got = self.comm.scatter(parts, root=opts.rootRank)
        self._write(outputs[0], got.view(outputs[0].shape))
        return FakeWork(outputs)

    def send(self, tensors, dst, tag):
        self._check("send", tensors)
        self.comm.send(self.device.value(tensors[0]), dest=dst, tag=tag)
        return FakeWork(tensors)

    def recv(self, tensors, src, tag):
        if src is None or src < 0:
            raise NcclRefused("recvAnysource is not supported by NCCL")
        self._check("recv", tensors)
        self._write(tensors[0], self.comm.recv(source=src, tag=tag).view(tensors[0].shape))
        return FakeWork(tensors)

    def shutdown(self) -> None:
        pass


def fake_nccl_maker(comm, gpu: tuple, device: FakeDevice = None):
    """A ``make_backend`` for ``hpccomm._gpu.nccl_torch.TorchNCCL``: a
    :class:`FakeNCCL` on ``comm`` (a duplicate of the group's communicator:
    NCCL's own channel), made when the transport first needs it (as torch
    makes NCCL's group).  The maker records what it made in ``maker.made``."""

    def make(store, rank, size, timeout=None, name="", global_ranks=None):
        backend = FakeNCCL(comm, rank, size, gpu, device)
        make.made.append(backend)
        return backend

    make.made = []
    return make


__all__ = ["DEVICE", "FakeDevice", "StaleCudaTensor", "FakeStreams", "FakeNCCL", "NcclRefused", "fake_pinned",
           "fake_nccl_maker", "NCCL_DTYPES"]
