"""GPU collective benchmark: ``mpirun -n 2 python -m hpccomm bench-gpu``.

For each GPU transport this machine has (``mpi``: CUDA-aware MPI, ``nccl``:
torch's or CuPy's NCCL, ``staged``: pinned host copies, or those named with
``--transports``), times all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast and all_to_all_single on CUDA float32
tensors through hpccomm, and prints on rank 0 the median time, algorithm
bandwidth and bus bandwidth (nccl-tests' definitions) per size.  Every
result is checked against its closed form; a wrong result fails the run.

Each row runs the transport it names (``hpccomm.gpu.set_transport``, on every
rank between ops) and says which route ran, asked of hpccomm
(``hpccomm.gpu.taken()``), in its ``ran`` column: ``auto`` shows what the
route table chose.  Each timed call ends with ``torch.cuda.synchronize()``, so
a time covers the whole op whatever the transport's stream semantics.  ``--device cpu`` runs
the same loop on CPU tensors (hpccomm's host path), to try the tool where
there is no GPU; its figures are host figures, labelled so.

Options: ``--sizes 1K,1M,64M`` (bytes per rank's input), ``--iters``,
``--warmup``, ``--json FILE``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

import hpccomm

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
OPS = tuple(BUS_FACTOR)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


#: The hpccomm op each benchmarked op runs (the name hpccomm.gpu.taken() reports it under).
OP_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
            "reduce_scatter": "reduce_scatter_tensor", "broadcast": "broadcast", "all_to_all": "all_to_all_single"}


def make_op(op: str, nbytes: int, n: int, rank: int, full, group=None):
    """``(run, check, bytes for the bandwidth)`` for one op on ``nbytes`` per
    rank; ``full(count, value)`` makes a float32 tensor on the device;
    ``group``: the process group (default the world)."""
    count = max(nbytes // 4, n)
    count -= count % n
    if op == "all_reduce":
        t = full(count, 0.0)

        def run():
            t.fill_(rank + 1.0)
            dist.all_reduce(t, group=group)

        return run, lambda: bool(torch.all(t == n * (n + 1) / 2)), count * 4
    if op == "all_gather":
        inp = full(count // n, float(rank))
        out = full(count, -1.0)

        def check():
            return all(bool(torch.all(part == r)) for r, part in enumerate(out.chunk(n)))

        return (lambda: dist.all_gather_into_tensor(out, inp, group=group)), check, count * 4
    if op == "reduce_scatter":
        inp = full(count, 1.0)
        out = full(count // n, 0.0)
        return (lambda: dist.reduce_scatter_tensor(out, inp, group=group)), (lambda: bool(torch.all(out == n))), \
            count * 4
    if op == "broadcast":
        t = full(count, 0.0)

        def run():
            t.fill_(float(rank))
            dist.broadcast(t, src=0, group=group)

        return run, lambda: bool(torch.all(t == 0)), count * 4
    inp = full(count, float(rank))
    out = full(count, -1.0)

    def check():
        return all(bool(torch.all(part == r)) for r, part in enumerate(out.chunk(n)))

    return (lambda: dist.all_to_all_single(out, inp, group=group)), check, count * 4


def time_op(run, sync, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        run()
    sync()
    samples = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def available_transports() -> list:
    """The transports this machine has, as every rank finds them (a forced one that cannot serve is left out)."""
    from hpccomm._gpu import findings, select

    caps = findings.capabilities()
    found = []
    for name in ("mpi", "composed", "nccl", "staged"):
        try:
            select.route_table([select.Facts.of(name, None, caps)])
            found.append(name)
        except select.NoTransport as exc:
            if dist.get_rank() == 0:
                print(f"# transport {name}: not available ({exc})")
    return found


#: What ``--compare`` sets for each route it times (hpccomm.gpu.set_transport), and ``gloo``: torch's gloo
#: group over the same ranks, on the same CUDA tensors (gloo's own CUDA path, the reference).
COMPARE = ("nccl", "mpi", "composed", "staged", "gloo")


def measure(transports, ops, sizes, full, sync, iters: int, warmup: int) -> list:
    """One row per transport, op and size: the slowest rank's median time,
    bandwidths, whether every rank's result was right, and ``ran``: the route
    hpccomm says the op took (hpccomm.gpu.taken()), ``"host"`` on CPU
    tensors, ``"gloo"`` for the gloo reference."""
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for transport in transports:
        group = None
        if transport == "gloo":
            group = dist.new_group(backend="gloo")
        elif transport != "host":
            hpccomm.gpu.set_transport(transport)  # every rank, between ops: the routes are made anew
            try:  # a transport that cannot serve this group (NCCL on shared GPUs) is refused on every rank alike
                make_op(ops[0], 4 * n, n, rank, full)[0]()
            except hpccomm.OpError as exc:
                if rank == 0:
                    print(f"# transport {transport}: not available here ({exc})")
                continue
        for op in ops:
            if transport == "composed" and op not in ("all_reduce", "reduce_scatter"):
                continue  # (hpccomm composes reductions only)
            for nbytes in sizes:
                run, check, moved = make_op(op, nbytes, n, rank, full, group)
                seconds = time_op(run, sync, iters, warmup)
                flags = torch.tensor([0 if check() else 1])
                dist.all_reduce(flags)  # a wrong result on any rank fails the run
                seconds_max = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(seconds_max, op=dist.ReduceOp.MAX)
                t = seconds_max.item()
                algbw = moved / t / 1e9
                ran = transport if transport in ("host", "gloo") else hpccomm.gpu.taken().get(OP_NAMES[op], "none")
                rows.append({"transport": transport, "ran": ran, "op": op, "bytes": moved, "time_us": t * 1e6,
                             "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](n),
                             "correct": int(flags.item()) == 0})
        if group is not None:
            dist.destroy_process_group(group)
    if any(t not in ("host", "gloo") for t in transports):
        hpccomm.gpu.set_transport(None)
    return rows


def compare_table(rows) -> str:
    """``--compare``: one line per op and size, each route's time and bus
    bandwidth side by side, and each route's speed against gloo's."""
    routes = [t for t in dict.fromkeys(r["transport"] for r in rows)]
    by = {(r["transport"], r["op"], r["bytes"]): r for r in rows}
    head = f"{'op':>15} {'bytes':>10}" + "".join(f" {t + ' us':>11} {t + ' GB/s':>11}" for t in routes)
    lines = [head + "  (vs gloo: time ratio, < 1 is faster)"]
    for op, nbytes in dict.fromkeys((r["op"], r["bytes"]) for r in rows):
        cells, ratios = [], []
        gloo = by.get(("gloo", op, nbytes))
        for t in routes:
            r = by.get((t, op, nbytes))
            cells.append(f" {'-':>11} {'-':>11}" if r is None else
                         f" {r['time_us']:>11.1f} {r['busbw_GBps']:>11.3f}{'!' if not r['correct'] else ''}")
            if r is not None and gloo is not None and t != "gloo":
                ratios.append(f"{t} {r['time_us'] / gloo['time_us']:.2f}")
        lines.append(f"{op:>15} {nbytes:>10}" + "".join(cells) + ("  " + ", ".join(ratios) if ratios else ""))
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--transports", default="", help="comma-separated (default: every available one)")
    parser.add_argument("--compare", action="store_true",
                        help="every route side by side for each op and size, with gloo's CUDA path as the reference "
                             "(nccl, mpi, composed, staged, gloo: those this machine has)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", default="", help="write the results to this file (rank 0)")


def main(argv=None) -> int:
    """``python -m hpccomm.tools.bench_gpu ...``: the same as ``hpccomm bench-gpu ...``."""
    parser = argparse.ArgumentParser(prog="hpccomm bench-gpu", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    warnings.filterwarnings("ignore", message="`torch.distributed.*` is deprecated", category=FutureWarning)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("hpccomm bench-gpu: no GPU (torch.cuda.is_available() is False); nothing measured. "
              "Use --device cpu to try the tool on hpccomm's host path", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:  # (the same verdict on every rank, before any communication)
        print(f"hpccomm bench-gpu: error: unknown op(s) {unknown}; choose from {', '.join(OPS)}", file=sys.stderr)
        return 2
    hpccomm.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    if args.device == "cpu":  # hpccomm's host path (and with --compare, gloo's, on the same CPU tensors)
        transports, device, sync = ["host"] + (["gloo"] if args.compare else []), torch.device("cpu"), (lambda: None)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
        available = [t for t in args.transports.split(",") if t] or available_transports()
        transports = [t for t in COMPARE if t == "gloo" or t in available] if args.compare else available
    if rank == 0:
        print(f"# hpccomm bench-gpu: {n} ranks, device {device}, transports {', '.join(transports)}")
    rows = measure(transports, ops, sizes, lambda count, value: torch.full((count,), value, device=device), sync,
                   args.iters, args.warmup)
    if rank == 0:
        print(compare_table(rows) if args.compare else render(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": n, "device": str(device), "results": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["correct"] for r in rows) else 1


def render(rows) -> str:
    """The table: each row says the transport asked for and the route that ran."""
    lines = [f"{'asked':>9} {'ran':>24} {'op':>15} {'bytes':>12} {'time_us':>11} {'algbw_GB/s':>11} "
             f"{'busbw_GB/s':>11}"]
    for r in rows:
        mark = "" if r["correct"] else "  WRONG RESULT"
        lines.append(f"{r['transport']:>9} {r['ran'][:24]:>24} {r['op']:>15} {r['bytes']:>12} {r['time_us']:>11.1f} "
                     f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}{mark}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
