"""What each benchmarked op moves, how it is called, and how its result is checked.

Pure torch (no MPI): unit-tested without a launcher.  An op's *case* for one
size holds its buffers and three functions: ``fill()`` resets the inputs and
poisons the outputs with 0 (never a valid result: every input value is >= 1),
``call(...)`` communicates, and ``wrong()`` counts the output elements that
differ from the closed-form expected result.  The sweep runs
``fill``/``call``/``wrong`` around every timed iteration (only ``call`` is
timed), so ``#wrong`` covers every result, not a sample.

Input values are small rank-dependent integers, exactly representable in
every dtype benchmarked (bfloat16 included), so a sum is exact whatever the
reduction order and any misplaced, missing or doubled contribution shows:

- data-moving ops: element ``i`` of rank ``r``'s input is ``1 + (7r + i) % 61``;
- reductions: ``1 + (3r + i) % 7`` (sum, avg, min, max) or
  ``1 + (r + i) % 2`` (product: a product of 1s and 2s).

Sizes, counts and bandwidths follow nccl-tests (doc/PERFORMANCE.md there):
``size`` is the bytes of the larger buffer, ``count`` the elements nccl-tests
prints (per rank for the gather/scatter family), ``algbw = size / time`` and
``busbw = algbw * bus_factor(op, n)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

#: Placements a column can show: nccl-tests' out-of-place and in-place.
OOP, IP = "out-of-place", "in-place"

#: dtype names accepted on the command line -> torch dtype (nccl-tests' short names too).
DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
}

#: redop names -> torch.distributed.ReduceOp attribute names.
REDOPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}


def type_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class OpSpec:
    """One benchmarked op: its name, torch name, bus factor and shape."""

    name: str
    torch_name: str
    factor: Callable[[int], float]
    per_rank: bool = False  # the buffer is n pieces: count rounds to a multiple of n
    rooted: bool = False
    reduces: bool = False
    placements: tuple = (OOP, IP)
    sweeps: bool = True  # barrier has no size
    min_ranks: int = 1
    doc: str = ""


def _one(n: int) -> float:
    return 1.0


def _ring(n: int) -> float:
    return (n - 1) / n


def _allreduce(n: int) -> float:
    return 2 * (n - 1) / n


OPS: dict = {s.name: s for s in (
    OpSpec("all_reduce", "all_reduce", _allreduce, reduces=True, placements=(IP,),
           doc="torch's all_reduce is in place only"),
    OpSpec("all_gather", "all_gather_into_tensor", _ring, per_rank=True,
           doc="in place: the input is this rank's piece of the output"),
    OpSpec("reduce_scatter", "reduce_scatter_tensor", _ring, per_rank=True, reduces=True,
           doc="in place: the output is this rank's piece of the input"),
    OpSpec("all_to_all", "all_to_all_single", _ring, per_rank=True,
           doc="in place: output and input are one tensor"),
    OpSpec("broadcast", "broadcast", _one, rooted=True, placements=(IP,)),
    OpSpec("reduce", "reduce", _one, rooted=True, reduces=True, placements=(IP,),
           doc="only the root's result is checked (the only output)"),
    OpSpec("gather", "gather", _ring, per_rank=True, rooted=True,
           doc="in place: the root's own piece of gather_list is its input"),
    OpSpec("scatter", "scatter", _ring, per_rank=True, rooted=True,
           doc="in place: the root's output is its own piece of scatter_list"),
    OpSpec("sendrecv", "send/recv", _one, placements=(OOP,), min_ranks=2,
           doc="ping-pong between ranks 2k and 2k+1; time = round trip / 2"),
    OpSpec("barrier", "barrier", _one, placements=(OOP,), sweeps=False),
)}

#: Other spellings accepted by --ops (torch's names).
ALIASES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
           "all_to_all_single": "all_to_all", "alltoall": "all_to_all", "send_recv": "sendrecv",
           "ping_pong": "sendrecv", "allreduce": "all_reduce", "allgather": "all_gather",
           "bcast": "broadcast"}


def parse_ops(text: str) -> list:
    """``"all"`` or a comma list of op names (torch's names accepted) -> OpSpecs; ValueError names the bad one."""
    if text.strip() == "all":
        return list(OPS.values())
    out = []
    for raw in text.split(","):
        name = ALIASES.get(raw.strip(), raw.strip())
        if name not in OPS:
            raise ValueError(f"unknown op {raw!r}; choose from all, {', '.join(OPS)}")
        out.append(OPS[name])
    return out


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks."""
    return OPS[op].factor(n)


def count_for(spec: OpSpec, nbytes: int, itemsize: int, n: int) -> int:
    """Elements in the larger buffer for a requested size: at least one per
    rank, a multiple of ``n`` where the buffer is made of per-rank pieces."""
    count = max(nbytes // itemsize, 1)
    if spec.per_rank:
        count = max(count // n, 1) * n
    return count


def sizes(lo: int, hi: int, factor: int) -> list:
    """``lo, lo*factor, ...`` up to ``hi`` inclusive (the -b/-e/-f sweep)."""
    if lo < 1 or hi < lo or factor < 2:
        raise ValueError(f"bad sweep: min {lo}, max {hi}, factor {factor} (need 1 <= min <= max, factor >= 2)")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


# -- values -----------------------------------------------------------------

def _periodic(table: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Elements ``start .. start+length`` of the infinite repetition of ``table``."""
    p = table.numel()
    first = start % p
    reps = (first + length) // p + 1
    return table.repeat(reps)[first:first + length].clone()


def _data_table(rank: int) -> torch.Tensor:
    return 1 + (7 * rank + torch.arange(61, dtype=torch.float64)) % 61


def _red_period(redop: str) -> int:
    return 2 if redop == "prod" else 7


def _red_table(rank: int, redop: str) -> torch.Tensor:
    if redop == "prod":
        return 1 + (rank + torch.arange(2, dtype=torch.float64)) % 2
    return 1 + (3 * rank + torch.arange(7, dtype=torch.float64)) % 7


def data(rank: int, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s data-op input, elements ``start..start+length``."""
    return _periodic(_data_table(rank), start, length).to(dtype)


def red_input(rank: int, start: int, length: int, dtype: torch.dtype, redop: str) -> torch.Tensor:
    """Rank ``rank``'s reduction input, elements ``start..start+length``."""
    return _periodic(_red_table(rank, redop), start, length).to(dtype)


def red_expected(n: int, start: int, length: int, dtype: torch.dtype, redop: str) -> torch.Tensor:
    """The reduction of every rank's :func:`red_input` over ``n`` ranks, in closed form."""
    tables = torch.stack([_red_table(r, redop) for r in range(n)])  # exact in float64
    if redop in ("sum", "avg"):
        table = tables.sum(0)
    elif redop == "prod":
        table = tables.prod(0)
    elif redop == "min":
        table = tables.min(0).values
    elif redop == "max":
        table = tables.max(0).values
    else:
        raise ValueError(f"unknown redop {redop!r}")
    if redop == "avg":
        if dtype.is_floating_point:
            # hpccomm and NCCL sum in the dtype (exact here), then divide in it.
            return (_periodic(table, start, length).to(dtype) / n).to(dtype)
        table = torch.div(table, n, rounding_mode="trunc")  # integer AVG truncates, as NCCL's
    return _periodic(table, start, length).to(dtype)


def count_wrong(out: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of ``out`` that differ from ``expected`` (NaN counts as wrong)."""
    if out.shape != expected.shape:
        return max(out.numel(), expected.numel())
    return int((out != expected).sum())


# -- cases ------------------------------------------------------------------

@dataclass
class Case:
    """The buffers of one (op, size, placement) on this rank, for one backend.

    ``tensors`` is what the torch call and the raw MPI call use; ``fill`` and
    ``wrong`` are untimed; ``nbytes``/``count`` are the size and count columns.
    """

    spec: OpSpec
    placement: str
    count: int  # elements in the larger buffer
    nbytes: int
    param_count: int  # what nccl-tests prints in its count column
    fill: Callable[[], None]
    wrong: Callable[[], int]
    tensors: dict = field(default_factory=dict)
    role: str = ""  # sendrecv: "ping", "pong" or "idle"


def make_case(spec: OpSpec, placement: str, count: int, dtype: torch.dtype, rank: int, n: int,
              redop: str = "sum", root: int = 0, corrupt: bool = False) -> Case:
    """Buffers, fill and check for one op on this rank.  ``corrupt`` flips one
    output element after every check-worthy result (the checker's self-test)."""
    item = torch.empty((), dtype=dtype).element_size()
    per = count // n if spec.per_rank else count
    checks: list = []  # (output tensor, expected) pairs compared by wrong()
    inits: list = []  # (buffer, value or None = zeros) applied by fill()
    t: dict = {}
    name = spec.name
    role = ""

    if name == "all_reduce":
        t["buf"] = torch.empty(count, dtype=dtype)
        inits.append((t["buf"], red_input(rank, 0, count, dtype, redop)))
        checks.append((t["buf"], red_expected(n, 0, count, dtype, redop)))
    elif name == "all_gather":
        t["out"] = torch.empty(count, dtype=dtype)
        t["inp"] = t["out"][rank * per:(rank + 1) * per] if placement == IP else torch.empty(per, dtype=dtype)
        inits += [(t["out"], None), (t["inp"], data(rank, 0, per, dtype))]
        checks.append((t["out"], torch.cat([data(s, 0, per, dtype) for s in range(n)])))
    elif name == "reduce_scatter":
        t["inp"] = torch.empty(count, dtype=dtype)
        t["out"] = t["inp"][rank * per:(rank + 1) * per] if placement == IP else torch.empty(per, dtype=dtype)
        inits += [(t["out"], None), (t["inp"], red_input(rank, 0, count, dtype, redop))]
        checks.append((t["out"], red_expected(n, rank * per, per, dtype, redop)))
    elif name == "all_to_all":
        t["inp"] = torch.empty(count, dtype=dtype)
        t["out"] = t["inp"] if placement == IP else torch.empty(count, dtype=dtype)
        inits += [(t["out"], None), (t["inp"], data(rank, 0, count, dtype))]
        checks.append((t["out"], torch.cat([data(s, rank * per, per, dtype) for s in range(n)])))
    elif name == "broadcast":
        t["buf"] = torch.empty(count, dtype=dtype)
        inits.append((t["buf"], data(root, 0, count, dtype) if rank == root else None))
        checks.append((t["buf"], data(root, 0, count, dtype)))
    elif name == "reduce":
        t["buf"] = torch.empty(count, dtype=dtype)
        inits.append((t["buf"], red_input(rank, 0, count, dtype, redop)))
        if rank == root:
            checks.append((t["buf"], red_expected(n, 0, count, dtype, redop)))
    elif name == "gather":
        if rank == root:
            t["out"] = torch.empty(count, dtype=dtype)
            t["out_list"] = list(t["out"].chunk(n))
            inits.append((t["out"], None))
            checks.append((t["out"], torch.cat([data(s, 0, per, dtype) for s in range(n)])))
        t["inp"] = t["out_list"][rank] if (placement == IP and rank == root) else torch.empty(per, dtype=dtype)
        inits.append((t["inp"], data(rank, 0, per, dtype)))
    elif name == "scatter":
        if rank == root:
            t["inp"] = torch.empty(count, dtype=dtype)
            t["inp_list"] = list(t["inp"].chunk(n))
            inits.append((t["inp"], data(root, 0, count, dtype)))
        t["out"] = t["inp_list"][rank] if (placement == IP and rank == root) else torch.empty(per, dtype=dtype)
        if not (placement == IP and rank == root):
            inits.append((t["out"], None))
        checks.append((t["out"], data(root, rank * per, per, dtype)))
    elif name == "sendrecv":
        partner = rank ^ 1
        role = "idle" if partner >= n else ("ping" if rank % 2 == 0 else "pong")
        t["partner"] = partner
        if role != "idle":
            t["buf"] = torch.empty(count, dtype=dtype)
            if role == "ping":  # sends its data, gets it back (echoed) in "back"
                t["back"] = torch.empty(count, dtype=dtype)
                inits += [(t["buf"], data(rank, 0, count, dtype)), (t["back"], None)]
                checks.append((t["back"], data(rank, 0, count, dtype)))
            else:
                inits.append((t["buf"], None))
                checks.append((t["buf"], data(partner, 0, count, dtype)))
    elif name == "barrier":
        pass
    else:
        raise ValueError(f"unknown op {name!r}")

    def fill() -> None:
        for buf, value in inits:
            if value is None:
                buf.zero_()
            else:
                buf.copy_(value)

    def wrong() -> int:
        if corrupt and checks:  # the checker's self-test: a result with one bad element
            out = checks[0][0]
            out.view(-1)[out.numel() // 2] = 0
        return sum(count_wrong(out, exp) for out, exp in checks)

    nbytes = 0 if not spec.sweeps else count * item
    param = per if spec.per_rank else count
    return Case(spec, placement, count if spec.sweeps else 0, nbytes, param if spec.sweeps else 0,
                fill, wrong, t, role)


def algbw(nbytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes) as nccl-tests prints it."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def busbw(op: str, nbytes: int, seconds: float, n: int) -> float:
    return algbw(nbytes, seconds) * bus_factor(op, n)


def percentile(sorted_samples: list, q: float) -> float:
    """Nearest-rank percentile of already sorted samples (q in 0..100)."""
    if not sorted_samples:
        return float("nan")
    k = max(0, min(len(sorted_samples) - 1, int(-(-q * len(sorted_samples) // 100)) - 1))
    return sorted_samples[k]


def stats(samples: list) -> dict:
    """median/min/max/p99 of per-iteration times (seconds)."""
    s = sorted(samples)
    if not s:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "p99": nan}
    mid = len(s) // 2
    median = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    return {"median": median, "min": s[0], "max": s[-1], "p99": percentile(s, 99)}


@dataclass
class Row:
    """One measured (backend, op, size, placement, mode) result."""

    backend: str
    op: str
    mode: str
    placement: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    min_us: float
    max_us: float
    p99_us: float
    algbw: float
    busbw: float
    wrong: int
    iters: int
    note: Optional[str] = None  # why there is no figure (unsupported by that backend)
    group: str = "world"  # the group the calls named: world (the default group) or sub (dist.new_group)
