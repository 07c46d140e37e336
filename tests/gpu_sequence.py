"""A random sequence of ops on device tensors, checked against the same ops
on CPU tensors (hpccomm's CPU path) and against each rank's own reference.

Used by the fake-device harness (tests/test_gpu_contracts.py, CPU tensors
that pose as CUDA tensors) and by the GPU machine's check
(tests/gpu/check.sh: real CUDA tensors), with the same code:

    report = run(seed=1, count=150, device=Device(to_device, to_host))

Every rank draws the same ops from ``random.Random(seed)`` (op, dtype,
ReduceOp, layout, root, sizes) and makes its own inputs from its rank.  Each
op runs twice: on device tensors through torch.distributed (whatever GPU route
the group takes) and on CPU tensors; the device result, read back, must equal
the CPU result (exactly, or within one rounding per term for floating-point
averages and scalings, which NCCL computes in another order), the same result
must be on every rank where the op replicates it, and an input the op only
reads must be unchanged.  A layout other than ``contiguous`` puts the device
tensor in a strided view of a larger tensor, whose other elements must stay
as they were.

``report`` counts ops, wrong results, refusals (an op that raised) and changed
inputs, with a line for each problem; the caller gathers the verdict.
"""
from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

R = dist.ReduceOp

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
DTYPES = FLOATS + INTS + [torch.bool] + COMPLEX
LAYOUTS = ["contiguous", "strided", "transposed", "offset"]
OPS = ["all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
       "reduce_scatter", "all_to_all_single", "all_to_all", "gather", "scatter", "send_recv", "recv_any"]


def redops_for(dtype) -> list:
    """The ReduceOps hpccomm's CPU path takes for ``dtype`` (its checks)."""
    if dtype == torch.bool:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_complex:
        return [R.SUM, R.AVG, "premul"]  # (torch.distributed itself refuses complex PRODUCT)
    if dtype.is_floating_point:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, "premul"]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.BAND, R.BOR, R.BXOR]


@dataclass
class Device:
    """How the sequence makes device tensors and reads them back."""

    to_device: Callable  # CPU tensor -> device tensor (a copy)
    to_host: Callable  # device tensor -> CPU tensor (a copy, after the device's work on it)


@dataclass
class Report:
    ops: int = 0
    wrong: int = 0
    refused: int = 0
    inputs_changed: int = 0
    problems: list = field(default_factory=list)

    def add(self, kind: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 40:
            self.problems.append(f"{kind}: {what}")


def values(n: int, dtype, rank: int, salt: int) -> torch.Tensor:
    """Small integers every dtype holds exactly, different per rank."""
    base = (torch.arange(n, dtype=torch.int64) * 7 + salt) % 3 + rank % 3 + 1
    if dtype == torch.bool:
        return (torch.arange(n) + salt + rank) % (rank + 2) == 0
    if dtype.is_complex:
        return torch.complex(base.double(), (-base).double()).to(dtype)
    return base.to(dtype)


def placed(t: torch.Tensor, layout: str, device: Device):
    """``(device tensor holding t's values in that layout, its whole device
    base, base's host copy)``: ``contiguous``; ``strided``, every other element
    of a larger tensor; ``transposed``, a 2-D transposed view (t's values read
    row by row; 1-D where t's size is odd); ``offset``, a view starting one
    element into a larger tensor."""
    n = t.numel()
    if layout == "contiguous":
        d = device.to_device(t.clone())
        return d, d, t.clone()
    if layout == "strided":
        base = torch.zeros(2 * max(n, 1), dtype=t.dtype)
        base[: 2 * n: 2] = t.reshape(-1)
        db = device.to_device(base)
        return db[: 2 * n: 2], db, base
    if layout == "transposed" and n % 2 == 0 and n >= 4:
        base = t.reshape(2, n // 2).t().contiguous()  # (n/2, 2): its transpose reads t row by row
        db = device.to_device(base)
        return db.t(), db, base
    base = torch.zeros(n + 3, dtype=t.dtype)
    base[1:n + 1] = t.reshape(-1)
    db = device.to_device(base)
    return db[1:n + 1], db, base


def _equal(a: torch.Tensor, b: torch.Tensor, loose: bool) -> bool:
    a, b = a.reshape(-1), b.reshape(-1)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not loose or not (a.dtype.is_floating_point or a.dtype.is_complex):
        return torch.equal(a, b)
    eps = {torch.float16: 2 ** -8, torch.bfloat16: 2 ** -5}.get(a.dtype, 2 ** -20)
    wide = torch.complex128 if a.dtype.is_complex else torch.float64
    return torch.allclose(a.to(wide), b.to(wide), rtol=eps * 4, atol=eps * 4)


def draw(seed: int, count: int, n: int, ops=OPS, dtypes=DTYPES, layouts=LAYOUTS, any_source=True) -> list:
    """``count`` random steps ``(op, dtype, layout, redop, root, m)`` for a
    group of ``n`` ranks (the same list on every rank for the same seed)."""
    rng = random.Random(seed)
    usable = [o for o in ops if (o not in ("send_recv", "recv_any") or n > 1) and (o != "recv_any" or any_source)]
    steps = []
    for _ in range(count):
        op, dtype, layout, root = rng.choice(usable), rng.choice(dtypes), rng.choice(layouts), rng.randrange(n)
        redop = rng.choice(redops_for(dtype)) if op in REDUCING else None
        steps.append((op, dtype, layout, redop, root, rng.choice([1, 3, 4, 6, 8, 17]), rng.random() < 0.3))
    return steps


REDUCING = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")


def battery(n: int, any_source=True) -> list:
    """Every dtype with every ReduceOp the CPU path takes for it, in the three
    reducing op shapes, contiguous and strided; every other op with every
    dtype, strided: the steps of :func:`run` that cover each rewrite."""
    steps = []
    for i, dtype in enumerate(DTYPES):
        for j, redop in enumerate(redops_for(dtype)):
            for k, op in enumerate(("all_reduce", "reduce_scatter_tensor", "reduce")):
                steps.append((op, dtype, LAYOUTS[(i + j + k) % len(LAYOUTS)], redop, (i + j) % n, 3 + (j % 2),
                              (i + j + k) % 3 == 0))
        for op in OPS:
            if op in REDUCING or (op in ("send_recv", "recv_any") and n == 1) or (op == "recv_any" and not any_source):
                continue
            steps.append((op, dtype, "strided", None, i % n, 4, i % 2 == 0))
    return steps


def run(seed: int, count: int, device: Device, ops=OPS, dtypes=DTYPES, layouts=LAYOUTS, any_source=True,
        log=None, steps=None) -> Report:
    """``count`` random ops (see the module docstring), or ``steps`` (from
    :func:`battery`); every rank calls it with the same arguments."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if steps is None:
        steps = draw(seed, count, n, ops, dtypes, layouts, any_source)
    report = Report()
    comm = _verdict_comm()
    for step, (op, dtype, layout, redop, root, m, asynchronous) in enumerate(steps):
        if redop == "premul":
            redop = dist._make_nccl_premul_sum(2.0)
        desc = f"#{step} {op} {str(dtype).replace('torch.', '')} {layout} m={m} root={root}" + \
            (f" {redop}" if redop is not None else "") + (" async" if asynchronous else "")
        if log:
            log(desc)
        try:
            problems = _one(op, dtype, layout, redop, root, m, rank, n, device, step, asynchronous)
        except Exception as exc:  # noqa: BLE001 - counted and reported, with where it was raised
            where = traceback.extract_tb(exc.__traceback__)[-1]
            problems = [("refused", f"{type(exc).__name__}: {str(exc)[:300]} "
                                    f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")]
        report.ops += 1
        for kind, what in problems:
            report.add(kind, f"{desc}: {what}")
        if (step + 1) % 25 == 0:
            comm.Barrier()  # keep the ranks within reach of each other
    return report


def _verdict_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _one(op, dtype, layout, redop, root, m, rank, n, device, salt, asynchronous=False):
    """One op on device tensors (``async_op=True`` then ``wait()`` for the
    collectives that have it, when ``asynchronous``) and on CPU tensors; the
    problems found."""
    problems = []
    loose = redop is not None and (redop == R.AVG or not isinstance(redop, type(R.SUM)))
    mine = values(m, dtype, rank, salt)
    comm = _verdict_comm()

    def check(name, got_dev, want_cpu, replicated=False):
        got = device.to_host(got_dev)
        if not _equal(got, want_cpu, loose):
            problems.append(("wrong", f"{name}: device {got.reshape(-1)[:8].tolist()} cpu "
                                      f"{want_cpu.reshape(-1)[:8].tolist()}"))
        if replicated:
            flat = torch.empty(got.numel(), dtype=got.dtype).copy_(got.reshape(-1))
            everyone = comm.allgather(flat.view(torch.uint8).numpy().tobytes())
            if len(set(everyone)) != 1:
                problems.append(("wrong", f"{name}: differs between ranks"))

    def untouched(name, base_dev, base_host):
        if not torch.equal(device.to_host(base_dev), base_host):
            problems.append(("inputs_changed", name))

    def intact_outside(name, view_dev, base_dev, base_host):
        """The elements of the base outside the view: as they were."""
        if view_dev is base_dev:
            return
        after = device.to_host(base_dev).reshape(-1)
        before = base_host.reshape(-1)
        mask = torch.ones(before.numel(), dtype=torch.bool)
        mask[_indices(view_dev, base_dev)] = False
        if not torch.equal(after[mask], before[mask]):
            problems.append(("wrong", f"{name}: elements outside the view changed"))

    if op == "all_reduce":
        d, db, bh = placed(mine, layout, device)
        c = device.to_host(d)
        _done(dist.all_reduce(d, op=redop, async_op=asynchronous))
        dist.all_reduce(c, op=redop)
        check("all_reduce", d, c, replicated=True)
        intact_outside("all_reduce", d, db, bh)
    elif op == "reduce":
        d, db, bh = placed(mine, layout, device)
        c = device.to_host(d)
        dist.reduce(d, dst=root, op=redop)
        dist.reduce(c, dst=root, op=redop)
        check("reduce", d, c)
        if rank != root:
            untouched("reduce (not the root)", db, bh)
    elif op == "broadcast":
        d, db, bh = placed(mine, layout, device)
        c = device.to_host(d)
        _done(dist.broadcast(d, src=root, async_op=asynchronous))
        dist.broadcast(c, src=root)
        check("broadcast", d, c, replicated=True)
        intact_outside("broadcast", d, db, bh)
    elif op == "all_gather_into_tensor":
        d, db, bh = placed(mine, layout, device)
        out_cpu = torch.zeros(m * n, dtype=dtype)
        if layout == "offset" and m > 1:  # the in-place form: the input is this rank's slot of the output
            whole = device.to_device(torch.zeros(m * n, dtype=dtype))
            slot = whole[rank * m:(rank + 1) * m]
            slot.copy_(device.to_device(mine))
            dist.all_gather_into_tensor(whole, slot)
            dist.all_gather_into_tensor(out_cpu, mine.clone())
            check("all_gather_into_tensor (in place)", whole, out_cpu, replicated=True)
        else:
            out, ob, obh = placed(torch.zeros(m * n, dtype=dtype), layout, device)
            _done(dist.all_gather_into_tensor(out, d, async_op=asynchronous))
            dist.all_gather_into_tensor(out_cpu, mine.clone())
            check("all_gather_into_tensor", out, out_cpu, replicated=True)
            untouched("all_gather_into_tensor input", db, bh)
            intact_outside("all_gather_into_tensor output", out, ob, obh)
    elif op == "all_gather":
        d, db, bh = placed(mine, layout, device)
        outs = [placed(torch.zeros(m, dtype=dtype), layout, device)[0] for r in range(n)]
        cpu = [torch.zeros(m, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, d)
        dist.all_gather(cpu, mine.clone())
        for r in range(n):
            check(f"all_gather[{r}]", outs[r], cpu[r], replicated=True)
        untouched("all_gather input", db, bh)
    elif op == "reduce_scatter_tensor":
        big = values(m * n, dtype, rank, salt)
        d, db, bh = placed(big, layout, device)
        out, ob, obh = placed(torch.zeros(m, dtype=dtype), layout, device)
        c = torch.zeros(m, dtype=dtype)
        _done(dist.reduce_scatter_tensor(out, d, op=redop, async_op=asynchronous))
        dist.reduce_scatter_tensor(c, big.clone(), op=redop)
        check("reduce_scatter_tensor", out, c)
        untouched("reduce_scatter_tensor input", db, bh)
    elif op == "reduce_scatter":
        ins = [values(m, dtype, rank, salt + r) for r in range(n)]
        dins = [placed(t, layout, device)[0] for t in ins]
        out, _, _ = placed(torch.zeros(m, dtype=dtype), layout, device)
        c = torch.zeros(m, dtype=dtype)
        dist.reduce_scatter(out, dins, op=redop)
        dist.reduce_scatter(c, [t.clone() for t in ins], op=redop)
        check("reduce_scatter", out, c)
    elif op == "all_to_all_single":
        uneven = m % 2 == 1
        if uneven:
            splits_in = [(rank + r) % 3 + 1 for r in range(n)]
            splits_out = [(r + rank) % 3 + 1 for r in range(n)]
        else:
            splits_in = splits_out = [m] * n
        src = values(sum(splits_in), dtype, rank, salt)
        flat = "strided" if layout == "transposed" else layout  # split along dim 0: keep the tensor 1-D
        d, db, bh = placed(src, flat, device)
        out, _, _ = placed(torch.zeros(sum(splits_out), dtype=dtype), flat, device)
        c = torch.zeros(sum(splits_out), dtype=dtype)
        args = (splits_out, splits_in) if uneven else (None, None)
        dist.all_to_all_single(out, d, *args)
        dist.all_to_all_single(c, src.clone(), *args)
        check("all_to_all_single", out, c)
        untouched("all_to_all_single input", db, bh)
    elif op == "all_to_all":
        ins = [values(m, dtype, rank, salt + r) for r in range(n)]
        dins = [placed(t, layout, device)[0] for t in ins]
        outs = [placed(torch.zeros(m, dtype=dtype), layout, device)[0] for _ in range(n)]
        cpu = [torch.zeros(m, dtype=dtype) for _ in range(n)]
        dist.all_to_all(outs, dins)
        dist.all_to_all(cpu, [t.clone() for t in ins])
        for r in range(n):
            check(f"all_to_all[{r}]", outs[r], cpu[r])
    elif op == "gather":
        d, db, bh = placed(mine, layout, device)
        outs = [placed(torch.zeros(m, dtype=dtype), layout, device)[0] for _ in range(n)] \
            if rank == root else None
        cpu = [torch.zeros(m, dtype=dtype) for _ in range(n)] if rank == root else None
        dist.gather(d, outs, dst=root)
        dist.gather(mine.clone(), cpu, dst=root)
        if rank == root:
            for r in range(n):
                check(f"gather[{r}]", outs[r], cpu[r])
        untouched("gather input", db, bh)
    elif op == "scatter":
        ins = [values(m, dtype, rank, salt + r) for r in range(n)] if rank == root else None
        dins = [placed(t, layout, device)[0] for t in ins] if rank == root else None
        out, _, _ = placed(torch.zeros(m, dtype=dtype), layout, device)
        c = torch.zeros(m, dtype=dtype)
        dist.scatter(out, dins, src=root)
        dist.scatter(c, [t.clone() for t in ins] if rank == root else None, src=root)
        check("scatter", out, c)
    elif op in ("send_recv", "recv_any"):
        d, db, bh = placed(mine, layout, device)
        got, _, _ = placed(torch.zeros(m, dtype=dtype), layout, device)
        peer_to, peer_from = (rank + 1) % n, (rank - 1) % n
        expected = values(m, dtype, peer_from, salt)
        if rank % 2 == 0:
            dist.send(d, peer_to, tag=salt % 100)
            src = dist.recv(got, None if op == "recv_any" else peer_from, tag=salt % 100)
        else:
            src = dist.recv(got, None if op == "recv_any" else peer_from, tag=salt % 100)
            dist.send(d, peer_to, tag=salt % 100)
        check(op, got, expected)
        if src != peer_from:
            problems.append(("wrong", f"{op}: reported source {src}, sent by {peer_from}"))
        untouched(f"{op} input", db, bh)
    return problems


def _done(work) -> None:
    """Wait for an async op's Work (a blocking call returns None)."""
    if work is not None:
        work.wait()


def _indices(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The flat indices of ``base``'s elements that ``view`` covers (same storage)."""
    offset = view.storage_offset() - base.storage_offset()
    idx = torch.zeros((), dtype=torch.int64) + offset
    for size, stride in zip(view.shape, view.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(size) * stride
    return idx.reshape(-1)
