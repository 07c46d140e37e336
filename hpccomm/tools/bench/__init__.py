"""``hpccomm bench``: an nccl-tests-style sweep of every collective, side by
side with torch's gloo backend and raw mpi4py.

Run under a launcher::

    mpirun -n 2 hpccomm bench                       # every op, 8 B .. 64 MiB, float32, sum
    mpirun -n 2 hpccomm bench --ops all_reduce -b 8 -e 1M -f 4 --compare gloo,mpi4py
    mpirun -n 2 hpccomm bench -d float32,bfloat16 --json out.json --plot out.png
    mpirun -n 2 hpccomm bench --peak-memory         # peak RSS of a 1 GiB float32 all_reduce
    mpirun -n 2 python -m hpccomm bench --overlap 64

Every timed iteration is checked: inputs are reset and outputs poisoned
before it, and its output is compared element by element with the
closed-form expected result after it (untimed); ``#wrong`` counts the wrong
elements over all iterations, warm-up included, on every rank.  The exit
status is 1 if any result was wrong.  docs/benchmarks.md explains the columns.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import hpccomm

from . import backends, estimate, floor, report
from .ops import DTYPES, OPS, REDOPS, Row, make_case, parse_ops, sizes, stats, type_name
from .ops import algbw as _algbw
from .ops import busbw as _busbw
from .ops import count_for


def parse_bytes(text: str) -> int:
    """``"64M"`` -> 67108864 (K, M, G are powers of 1024; a plain number is bytes)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8, 64K, 1M, 1G)") from None


def add_arguments(p) -> None:
    g = p.add_argument_group("sweep (nccl-tests' flags where they exist)")
    g.add_argument("--ops", default="all", help="comma list or 'all': " + ", ".join(OPS) + " (default all)")
    g.add_argument("--full", action="store_true",
                   help="the whole nccl-tests sweep: 8 B to 64 MiB, x2 (many minutes: the estimate says how many); "
                        "default: 8 B to 16 MiB, x8 (about a minute on 2 cores)")
    g.add_argument("-b", "--min-bytes", type=parse_bytes, default=None, help="smallest size (default 8)")
    g.add_argument("-e", "--max-bytes", type=parse_bytes, default=None,
                   help="largest size (default 16M; 64M with --full)")
    g.add_argument("-f", "--factor", type=int, default=None,
                   help="size multiplier between steps (default 8; 2 with --full)")
    g.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    g.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    g.add_argument("-d", "--dtype", default="float32",
                   help="comma list of: " + ", ".join(DTYPES) + " (default float32)")
    g.add_argument("-o", "--redop", default="sum", choices=list(REDOPS), help="reduction (default sum)")
    g.add_argument("-r", "--root", type=int, default=0, help="root of broadcast/reduce/gather/scatter")
    g.add_argument("-a", "--async", dest="mode", action="store_const", const="async", default="blocking",
                   help="async mode: async_op=True then wait() (raw MPI: nonblocking call then Wait)")
    g.add_argument("--mode", dest="mode", choices=["blocking", "async", "both"], default="blocking",
                   help="blocking (default), async, or both")
    g.add_argument("--compare", default="", metavar="gloo,mpi4py,floor",
                   help="also run the sweep through these backends (they take turns iteration by iteration): "
                        "gloo (torch's CPU backend), mpi4py (raw MPI calls, the limit), floor (the same MPI "
                        "calls inside the thinnest Python backend torch accepts, on hpccomm's own route: "
                        "torch.distributed's own cost; all_reduce, all_gather, reduce_scatter, broadcast, "
                        "sendrecv)")
    g.add_argument("--group", choices=["world", "sub", "both"], default="world",
                   help="the group torch's calls name: world (the default group, default), sub (a group made "
                        "with dist.new_group over every rank: torch's and each backend's subgroup path), or both")
    g.add_argument("--stats", action="store_true", help="print min, max and p99 beside the median")
    g.add_argument("--batch", type=int, default=0, metavar="B",
                   help="ops timed back to back per sample (the time is the sample's / B), as nccl-tests "
                        "times a loop: 0 (default) = enough for about 1 MiB per sample, at most 100; "
                        "1 = every op timed on its own right after a barrier (includes the barrier's exit skew)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per rank (default: torch's own choice); they run the untimed "
                        "fill/check kernels and hpccomm's float16/bfloat16 reduction kernels")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write every row (and the comparison) as JSON")
    out.add_argument("--csv", metavar="FILE", help="write every row as CSV")
    out.add_argument("--plot", metavar="FILE.png", help="plot busbw and time against size (needs matplotlib)")
    out.add_argument("--quiet", action="store_true", help="no tables on stdout (with --json/--csv)")
    other = p.add_argument_group("other measurements (instead of the sweep)")
    other.add_argument("--peak-memory", type=int, nargs="?", const=1024, metavar="MIB",
                       help="peak RSS above baseline of one float32 all_reduce of MIB MiB (default 1024), "
                            "hpccomm and raw mpi4py")
    other.add_argument("--overlap", type=int, metavar="MIB", default=0,
                       help="compute/communication overlap of an async all_reduce of MIB MiB")
    other.add_argument("--overlap-matmuls", type=int, default=60)
    other.add_argument("--overlap-compute", choices=("matmul", "sleep"), default="matmul",
                       help="what runs beside the all_reduce: 256x256 matmuls on this core, or a wait "
                            "that leaves the CPU free (standing in for GPU kernels or I/O), as long "
                            "as the all_reduce alone takes")
    # Self-test of the checker: corrupt one element of every checked result.
    p.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hpccomm bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


#: The sizes swept: (smallest, largest, factor) by default (about a minute) and with --full (nccl-tests').
QUICK, FULL = (8, 16 << 20, 8), (8, 64 << 20, 2)


def resolve_sweep(args) -> None:
    """Fill in the sizes not given on the command line: the default sweep's,
    or the whole nccl-tests sweep's with ``--full``."""
    lo, hi, factor = FULL if args.full else QUICK
    args.min_bytes = lo if args.min_bytes is None else args.min_bytes
    args.max_bytes = hi if args.max_bytes is None else args.max_bytes
    args.factor = factor if args.factor is None else args.factor


def _fail(rank: int, message: str) -> int:
    if rank == 0:
        print(f"hpccomm bench: {message}", file=sys.stderr, flush=True)
    return 2


def run(args) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    # Argument errors first, the same on every rank, before any communication.
    try:
        specs = parse_ops(args.ops)
        dtypes = [DTYPES[d.strip()] if d.strip() in DTYPES else _bad_dtype(d) for d in args.dtype.split(",")]
        resolve_sweep(args)
        size_list = sizes(args.min_bytes, args.max_bytes, args.factor)
        others = [b.strip() for b in args.compare.split(",") if b.strip()]
        for b in others:
            if b not in ("gloo", "mpi4py", "floor"):
                raise ValueError(f"--compare {b!r}: choose from gloo, mpi4py, floor")
        if args.threads is not None and args.threads < 1:
            raise ValueError("--threads must be >= 1")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
    except ValueError as exc:
        return _fail(rank, str(exc))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail(rank, "--plot needs matplotlib, which is not installed: "
                               "pip install 'hpccomm[plot]' (or pip install matplotlib)")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hpccomm.init_process_group()
    MPI = hpccomm.mpi_module()

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        if args.overlap:
            overlap(args.overlap << 20, args.overlap_matmuls, MPI.COMM_WORLD.Barrier, args.overlap_compute)
            return 0
        if args.peak_memory:
            return peak_memory(args.peak_memory << 20)
        if not 0 <= args.root < n:
            return _fail(rank, f"--root {args.root} is not a rank of this {n}-rank job")
        return _sweep(args, specs, dtypes, size_list, others, rank, n)
    finally:
        dist.destroy_process_group()


def route_name() -> str:
    """Which of torch's routes hpccomm's default group takes (its adapter: docs/design.md), and on
    the Backend route whether torch records every op in its flight recorder (torch >= 2.15 hooks it
    onto the groups of backends that do not record themselves, about 5 µs per op here:
    docs/benchmarks.md; ``TORCH_FR_BUFFER_SIZE=0`` leaves it off.  The ProcessGroup route's ops never
    reach the hook)."""
    backend = floor.route_of() == "backend"
    name = ("c10d Backend (PyBackend trampoline)" if backend else "ProcessGroup subclass") \
        + f", torch {torch.__version__.split('+')[0]}"
    hooks = getattr(dist.distributed_c10d._world, "pg_flight_recorder_hooks", None)
    if backend and hooks and dist.group.WORLD in hooks:
        name += "; torch's flight recorder hook records every op (TORCH_FR_BUFFER_SIZE=0: off)"
    return name


def _cases(plan, kinds, modes, backend_names, args) -> list:
    """``(bytes, backends)`` of every case the sweep runs (for :func:`estimate.seconds`):
    ``bytes`` its size, doubled for a reduction (it computes as it moves), ``backends`` how
    many backends run it (the floor runs a few ops only)."""
    cases = []
    for dtype, spec, nbytes in plan:
        item = torch.empty((), dtype=dtype).element_size()
        size = count_for(spec, nbytes, item, 2) * item
        for _kind in kinds:
            for mode in modes:
                for placement in spec.placements:
                    running = sum(1 for b in backend_names if b != "floor" or floor.supported(
                        spec.name, placement, mode == "async", dtype, args.redop) is None)
                    cases.append((size * (2 if spec.reduces else 1), running))  # a reduction computes too
    return cases


def _bad_dtype(name: str):
    raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")


class _Progress:
    """``[k/N] op size backend`` on rank 0's stderr, rewritten in place; only on a terminal."""

    def __init__(self, total: int, on: bool) -> None:
        self.total, self.done, self.on, self.t0 = total, 0, on, time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if self.on:
            elapsed = time.monotonic() - self.t0
            eta = elapsed / self.done * (self.total - self.done)
            sys.stderr.write(f"\r\x1b[K[{self.done}/{self.total}] {what}  ({elapsed:.0f} s, ~{eta:.0f} s left)")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.on:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _scope(plan, size_list, backend_names) -> str:
    """``"11 ops x 8 sizes (8 B .. 16 MiB) x 4 backends"``: what the sweep covers."""
    ops = len({(d, s.name) for d, s, _ in plan})

    def b(x: int) -> str:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if x >= 1 << shift and x % (1 << shift) == 0:
                return f"{x >> shift} {unit}"
        return f"{x} B"

    return (f"{ops} op{'s' if ops != 1 else ''} x {len(size_list)} size{'s' if len(size_list) != 1 else ''} "
            f"({b(size_list[0])} .. {b(size_list[-1])}) x {len(backend_names)} backend"
            f"{'s' if len(backend_names) != 1 else ''}, estimated")


class _Clock:
    """One line per finished (dtype, op) on rank 0: how long it took, and how
    long the rest should take (the estimate's share of what is left, scaled by
    how the estimate has fared so far)."""

    def __init__(self, shares: dict, on: bool) -> None:
        self.shares, self.on, self.t0 = shares, on, time.monotonic()
        self.last, self.done_share, self.count = self.t0, 0.0, 0

    def done(self, key) -> None:
        if key is None or key not in self.shares:
            return
        now = time.monotonic()
        self.count += 1
        self.done_share += self.shares[key]
        left = sum(self.shares.values()) - self.done_share
        pace = (now - self.t0) / self.done_share if self.done_share > 0 else 1.0
        if self.on:
            dtype, op = key
            print(f"# [{self.count}/{len(self.shares)}] {op} ({type_name(dtype)}) done in {now - self.last:.1f} s; "
                  f"{now - self.t0:.0f} s so far, about {left * pace:.0f} s left", flush=True)
        self.last = now


def _sweep(args, specs, dtypes, size_list, others, rank: int, n: int) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # barriers, result gathering and the raw-MPI baseline
    kinds = ["world", "sub"] if args.group == "both" else [args.group]
    # The torch groups ops run on, by (backend, group kind): the default hpccomm group is None;
    # a "sub" group is one made by dist.new_group over every rank (every rank calls new_group).
    groups: dict = {}
    everyone = list(range(n))
    for kind in kinds:
        groups["hpccomm", kind] = None if kind == "world" else dist.new_group(everyone)
        if "gloo" in others:
            groups["gloo", kind] = dist.new_group(everyone if kind == "sub" else None, backend="gloo")
        if "floor" in others:  # on hpccomm's own route (a ProcessGroup or a c10d Backend)
            groups["floor", kind] = floor.new_group(everyone if kind == "sub" else None)
    backend_names = ["hpccomm", *others]
    modes = ["blocking", "async"] if args.mode == "both" else [args.mode]
    plan = []
    for dtype in dtypes:
        for spec in specs:
            if n < spec.min_ranks:
                continue
            for nbytes in (size_list if spec.sweeps else [0]):
                plan.append((dtype, spec, nbytes))
    per_step = len(modes) * len(backend_names) * len(kinds)
    progress = _Progress(sum(len(s.placements) for _, s, _ in plan) * per_step,
                         rank == 0 and sys.stderr.isatty())
    # the estimate, per (dtype, op): what the progress lines measure against
    shares: dict = {}
    for entry in plan:
        shares[entry[0], entry[1].name] = shares.get((entry[0], entry[1].name), 0.0) + \
            estimate.seconds(_cases([entry], kinds, modes, backend_names, args), args) - estimate.START
    expected = estimate.START + sum(shares.values())
    skipped = [s.name for s in specs if n < s.min_ranks]
    meta = {"hpccomm": hpccomm.__version__, "torch": torch.__version__, "ranks": n,
            "mpi": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
            "iters": args.iters, "warmup": args.warmup, "redop": args.redop, "root": args.root,
            "modes": modes, "groups": kinds, "backends": backend_names, "route": route_name(),
            "torch_threads": torch.get_num_threads(), "host": os.uname().nodename,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "check": "every warm-up op and one op per timed sample: inputs reset, outputs poisoned, every element compared",
            "time": "per sample: B ops back to back after a barrier (--batch), divided by B, max over ranks; backends take turns sample by sample; the row's time is the median over samples; every warm-up op and one op per sample are checked"}
    if rank == 0 and not args.quiet:
        print(f"# hpccomm bench: hpccomm {meta['hpccomm']}, torch {meta['torch']}, {meta['mpi']}, {n} ranks\n"
              f"# time: median over samples of the slowest rank's time per op; a sample is B ops back to back "
              f"(B = --batch {args.batch or 'auto: ~1 MiB per sample, at most 100'}), {args.iters} ops per size "
              f"(at least 5 samples), after {args.warmup} warm-up\n"
              f"# #wrong = wrong elements in every checked result: each warm-up op and one op per sample\n"
              f"# algbw = size / time, busbw = algbw x nccl-tests' factor; GB/s = 1e9 B/s\n"
              f"# route: {meta['route']}" + ("; the floor takes the same route" if "floor" in others else "")
              + (f"\n# skipped (need more ranks): {', '.join(skipped)}" if skipped else "")
              + f"\n# {_scope(plan, size_list, backend_names)}: {estimate.say(expected)} on a 2-core machine "
              f"(docs/benchmarks.md)" + ("" if args.full else "; --full: the whole nccl-tests sweep"),
              flush=True)
    rows: list = []
    pending: list = []  # rows of the (dtype, op) being swept, printed when it ends
    key = None
    clock = _Clock(shares, rank == 0 and not args.quiet)
    for dtype, spec, nbytes in plan:
        if key != (dtype, spec.name):
            _flush(pending, rank, args, others)
            clock.done(key)
            pending, key = [], (dtype, spec.name)
        item = torch.empty((), dtype=dtype).element_size()
        count = count_for(spec, nbytes, item, n)
        for kind in kinds:
            for mode in modes:
                for placement in spec.placements:
                    cases = [make_case(spec, placement, count, dtype, rank, n, args.redop, args.root, args.corrupt)
                             for _ in backend_names]
                    chosen = {b: groups[b, kind] for b in backend_names if b != "mpi4py"}
                    for row in _measure(cases, backend_names, mode, chosen, comm, args, dtype, rank, n):
                        row.group = kind
                        pending.append(row)
                        rows.append(row)
                        progress.step(f"{spec.name} {type_name(dtype)} {row.size} B {placement} {mode} {kind} "
                                      f"{row.backend}")
                    del cases
    progress.clear()
    _flush(pending, rank, args, others)
    clock.done(key)
    compare = report.compare_rows(rows, others) if others else []
    wrong = sum(r.wrong for r in rows)
    if rank == 0:
        if args.json:
            report.write_json(args.json, meta, rows, compare)
        if args.csv:
            report.write_csv(args.csv, rows)
        if args.plot:
            report.plot(args.plot, rows, f"hpccomm bench, {n} ranks ({meta['host']}, {meta['date']})")
        if wrong:
            print(f"# FAILED: {wrong} wrong result elements", file=sys.stderr, flush=True)
    comm.Free()
    return 1 if wrong else 0


def _flush(rows: list, rank: int, args, others: list) -> None:
    """Print the finished (dtype, op)'s tables on rank 0."""
    if rank != 0 or args.quiet or not rows:
        return
    tables: dict = {}
    for r in rows:
        tables.setdefault((r.backend, r.mode, r.group), []).append(r)
    for rs in tables.values():
        print(report.table(rs, args.stats), flush=True)
    for mode, kind in dict.fromkeys((r.mode, r.group) for r in rows):
        entries = report.compare_rows([r for r in rows if r.mode == mode and r.group == kind], others) \
            if others else []
        if entries:
            print(report.compare_table(entries, others), flush=True)


def _measure(cases, backend_names, mode: str, groups, comm, args, dtype, rank: int, n: int) -> list:
    """Time and check one (op, size, placement, mode) on every backend
    (collective over every rank).  The backends take turns iteration by
    iteration, so a burst of load on the machine hits them all alike."""
    spec = cases[0].spec
    root = args.root if spec.rooted else -1
    asynchronous = mode == "async"
    rows, runs = [], []  # runs: (row, case, fn, samples) of the backends that can run it
    for backend, case in zip(backend_names, cases):
        row = Row(backend, spec.name, mode, case.placement, case.nbytes, case.param_count, type_name(dtype),
                  args.redop if spec.reduces else "none", root, *([float("nan")] * 6), 0, args.iters)
        rows.append(row)
        try:
            why = floor.supported(spec.name, case.placement, asynchronous, dtype, args.redop) \
                if backend == "floor" else None
            if why is not None:
                raise backends.Unsupported(why)
            if backend == "mpi4py":
                fn = backends.call_mpi(case, comm, asynchronous, args.redop, args.root, dtype)
            else:
                fn = backends.call_torch(case, groups[backend], backend, asynchronous,
                                         args.redop, args.root)
        except backends.Unsupported as exc:  # decided from the arguments alone: the same on every rank
            row.note = str(exc)
            continue
        runs.append((row, case, fn, []))
    barrier = comm.Barrier
    wrong = [0] * len(runs)
    batch = args.batch or max(1, min(100, (1 << 20) // max(1, cases[0].nbytes)))
    rounds = args.iters if batch == 1 else max(5, args.iters // batch)  # samples for the median

    def checked(k, case, fn):
        case.fill()
        barrier()
        fn()
        wrong[k] += case.wrong()

    for _ in range(args.warmup):
        for k, (_row, case, fn, _s) in enumerate(runs):
            checked(k, case, fn)
    perf = time.perf_counter
    gc_was = gc.isenabled()
    gc.disable()  # a collection inside a timed call is noise, not communication
    try:
        for _ in range(rounds):
            for k, (_row, case, fn, samples) in enumerate(runs):
                case.fill()
                barrier()
                t0 = perf()
                for _ in range(batch):  # back to back, as nccl-tests times its loop
                    fn()
                samples.append((perf() - t0) / batch)
                if batch == 1:
                    wrong[k] += case.wrong()
                else:  # in-place ops changed their inputs: check a fresh, untimed op
                    checked(k, case, fn)
    finally:
        if gc_was:
            gc.enable()
    for k, (row, case, _fn, samples) in enumerate(runs):
        everyone = comm.gather(samples, root=0)
        row.wrong = comm.allreduce(wrong[k])
        if rank != 0:
            continue
        slowest = [max(col) for col in zip(*everyone)]  # an op is done when its last rank is
        if spec.name == "sendrecv":
            slowest = [t / 2 for t in slowest]  # one way: half the round trip
        st = stats(slowest)
        row.time_us, row.min_us, row.max_us, row.p99_us = (st[q] * 1e6 for q in ("median", "min", "max", "p99"))
        if case.nbytes:
            row.algbw = _algbw(case.nbytes, st["median"])
            row.busbw = _busbw(spec.name, case.nbytes, st["median"], n)
    return rows


# -- other measurements ---------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(nbytes: int) -> int:
    """Print the peak RSS above the baseline of one float32 all_reduce of
    ``nbytes`` (the tensor's own pages included), through hpccomm and through
    raw mpi4py on a numpy array; target < 1.25x the tensor (no hidden copies)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    count = nbytes // 4
    results = {}
    for name in ("hpccomm", "mpi4py"):
        gc.collect()
        comm.Barrier()
        resettable = _reset_peak()
        base = _status_kib("VmRSS")
        if name == "hpccomm":
            t = torch.ones(count)  # torch.ones writes every page: all of it is resident
            dist.all_reduce(t)
        else:
            t = np.ones(count, dtype=np.float32)
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)
        peak = _status_kib("VmHWM")  # before the check, whose temporaries are not the op's
        step = 1 << 22
        ok = all(bool((t[i:i + step] == n).all()) for i in range(0, count, step))
        del t
        results[name] = ((peak - base) * 1024, resettable, ok)
    everyone = comm.gather(results, root=0)
    bad = 0
    if rank == 0:
        print(f"# peak memory: one float32 all_reduce of {nbytes / 2**20:.0f} MiB on {n} ranks; peak RSS "
              f"(VmHWM) minus the RSS just before allocating the tensor; target < 1.25x the tensor size")
        print(f"#{'backend':>9} {'rank':>5} {'peak above base (MiB)':>22} {'x tensor':>9} {'result':>7}")
        for r, res in enumerate(everyone):
            for name, (extra, resettable, ok) in res.items():
                ratio = extra / nbytes
                bad += not ok
                flag = "" if resettable else "  (VmHWM could not be reset: includes earlier peaks)"
                print(f" {name:>9} {r:>5} {extra / 2**20:>22.1f} {ratio:>9.3f} {'ok' if ok else 'WRONG':>7}{flag}")
        worst = max(res["hpccomm"][0] for res in everyone) / nbytes
        print(f"# hpccomm worst rank: {worst:.3f}x the tensor ({'meets' if worst < 1.25 else 'MISSES'} "
              f"the < 1.25x target)", flush=True)
    return 1 if comm.bcast(bad, root=0) else 0


def overlap(nbytes: int, iters: int, barrier, kind: str = "matmul") -> None:
    """Print (compute alone + comm alone) / (both together) for an async
    all_reduce of ``nbytes`` running while this thread computes.

    ``kind="matmul"``: the thread multiplies matrices on its core; the comm
    thread needs another core per rank to overlap (with 2 ranks on 2 cores the
    CPU, not hpccomm, bounds the ratio near 1).  ``kind="sleep"``: the thread
    waits with the CPU free, as a training loop does while GPU kernels or I/O
    run; the all_reduce must progress on its own for the ratio to reach 2."""
    torch.set_num_threads(1)  # compute on one core; the comm thread has the other
    t = torch.ones(nbytes // 4)
    a = torch.randn(256, 256)
    pause = [0.0]

    def compute():
        if kind == "sleep":
            time.sleep(pause[0])
            return
        for _ in range(iters):
            a @ a

    def comm():
        dist.all_reduce(t)

    def both():
        work = dist.all_reduce(t, async_op=True)
        compute()
        work.wait()

    def timed(fn, reps=5):
        fn()
        samples = []
        for _ in range(reps):
            barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    t_comm = timed(comm)
    pause[0] = t_comm
    t_compute, t_both = timed(compute), timed(both)
    if dist.get_rank() == 0:
        what = f"{iters} 256x256 matmuls run" if kind == "matmul" else \
            f"this thread waits {t_comm * 1e3:.1f} ms with the CPU free"
        print(f"# overlap: all_reduce of {nbytes >> 20} MiB async while {what}")
        print(f"compute alone {t_compute * 1e3:.1f} ms, comm alone {t_comm * 1e3:.1f} ms, "
              f"both {t_both * 1e3:.1f} ms: overlap ratio (compute + comm) / both = "
              f"{(t_compute + t_comm) / t_both:.2f} (1 = none, 2 = perfect)", flush=True)


__all__ = ["add_arguments", "run", "main"]
