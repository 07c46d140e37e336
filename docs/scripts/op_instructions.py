"""Instructions per op of hpccomm and of the floor, counted by valgrind's callgrind (docs/benchmarks.md).

    python docs/scripts/op_instructions.py                        # every case, this torch, hpccomm's default route
    HPCCOMM_ADAPTER=backend python docs/scripts/op_instructions.py   # the c10d Backend route (torch >= 2.14)
    python docs/scripts/op_instructions.py --ops all_reduce --modes async --which hpccomm --keep DIR
    HPCCOMM_MISMATCH_CHECK=first HPCCOMM_FR_BUFFER_SIZE=0 python docs/scripts/op_instructions.py --parts

One rank (no launcher needed: hpccomm starts a world of one), one process under callgrind for all
cases: per case a warm-up, then instrumentation on around N1 and then N2 ops (each dumped), and
instructions/op = (count(N2) - count(N1)) / (N2 - N1), which cancels the switching itself.  A
count, unlike a time, does not move with the machine's load.  sendrecv on one rank is a send to
itself and a receive from itself (torch refuses a blocking send to self: ``isend`` then a blocking
``recv``, then the send's ``wait``), two ops.  The floor takes hpccomm's route.  ``--keep DIR``
keeps the dumps (``callgrind_annotate DIR/out.K``; the table names each case's K).

``--parts``: instead of whole ops, the parts of a repeated blocking broadcast on the fast path
(hpccomm._ops.op_path.run), each called alone in the same loop, so that what is left over the floor
is named: the adapter's method (the Python function, called directly), ``op_path.run``, the op's
key, the cache lookup, the bound plan (``fill``), ``execute_bound`` and the MPI call in it,
``work.finished``, the two reads of torch's options, the floor's method
(hpccomm.tools.bench.floor: all its own Python) and its buffer spec, and an empty Python function
(the loop's own cost, in every row).  Run it with the fast path's options
(``HPCCOMM_MISMATCH_CHECK=first HPCCOMM_FR_BUFFER_SIZE=0``) or the defaults.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--modes", default="blocking,async")
    p.add_argument("--groups", default="world,sub", help="world (the default group), sub (dist.new_group)")
    p.add_argument("--which", default="hpccomm,floor")
    p.add_argument("--n1", type=int, default=200)
    p.add_argument("--n2", type=int, default=800)
    p.add_argument("--warmup", type=int, default=2500, help="ops run before each case's counts (HPCCOMM_FR_BUFFER_SIZE "
                   "or more: the flight recorder's rings full, as in a long run)")
    p.add_argument("--keep", metavar="DIR", help="keep the callgrind dumps in DIR")
    p.add_argument("--parts", action="store_true", help="the fast path's parts of a broadcast (module docstring)")
    p.add_argument("--inner", metavar="DIR", help=argparse.SUPPRESS)  # set when running under callgrind
    return p.parse_args(argv)


def outer(args) -> int:
    """Run this script again under callgrind, instrumentation off until each case asks."""
    out = args.keep or tempfile.mkdtemp(prefix="op-instructions-")
    os.makedirs(out, exist_ok=True)
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/out",
           sys.executable, "-W", "ignore", __file__, "--inner", out, *sys.argv[1:]]
    proc = subprocess.run(cmd, stderr=subprocess.DEVNULL)
    return proc.returncode


def inner(args) -> int:
    import torch
    import torch.distributed as dist

    import hpccomm
    from hpccomm.tools.bench import floor, route_name

    warnings.filterwarnings("ignore")
    hpccomm.init_process_group()
    n = dist.get_world_size()
    which, groups = args.which.split(","), args.groups.split(",")
    pgs = {}
    for w in which:
        for g in groups:
            if w == "floor":
                pgs[w, g] = floor.new_group(list(range(n)) if g == "sub" else None)
            else:
                pgs[w, g] = dist.new_group(list(range(n))) if g == "sub" else dist.group.WORLD
    t, r, o1 = torch.ones(2), torch.empty(2), torch.empty(2)
    out, inp = torch.empty(2 * n), torch.ones(2 * n)

    def make(pg, op, a):
        if op == "sendrecv":
            if a:
                def one():
                    s = dist.isend(t, 0, group=pg)
                    q = dist.irecv(r, 0, group=pg)
                    q.wait()
                    s.wait()
            else:
                def one():
                    s = dist.isend(t, 0, group=pg)
                    dist.recv(r, 0, group=pg)
                    s.wait()
            return one
        call = {"all_reduce": lambda: dist.all_reduce(t, group=pg, async_op=a),
                "all_gather": lambda: dist.all_gather_into_tensor(out, t, group=pg, async_op=a),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(o1, inp, group=pg, async_op=a),
                "broadcast": lambda: dist.broadcast(t, 0, group=pg, async_op=a)}[op]
        return (lambda: call().wait()) if a else call

    pid = str(os.getpid())

    def total(k):
        with open(f"{args.inner}/out.{k}") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("totals:"))

    def control(*what):
        subprocess.run(["callgrind_control", *what, pid], capture_output=True)

    cases, dump = [], 0

    def count(label, one):
        nonlocal dump
        for _ in range(args.warmup):
            one()
        for n in (args.n1, args.n2):
            control("-z")
            control("-i", "on")
            for _ in range(n):
                one()
            control("-i", "off")
            control(f"--dump={label}-{n}")
            dump += 1
        return dump - 1, dump

    if args.parts:
        parted = parts(dist.group.WORLD, t)
        for i, (label, one) in enumerate(parted.items()):
            cases.append((label,) + count(f"part-{i}", one))  # (a dump's name takes no parentheses or quotes)
        time.sleep(2)  # the last dump is written by valgrind's own thread
        print(f"# instructions per call of each part of a repeated blocking broadcast, 1 rank, {route_name()}")
        for label, k1, k2 in cases:
            print(f"  {label:28} {(total(k2) - total(k1)) / (args.n2 - args.n1):9.0f}  out.{k1} out.{k2}")
        dist.destroy_process_group()
        return 0
    for op in args.ops.split(","):
        for mode in args.modes.split(","):
            for g in groups:
                for w in which:
                    cases.append((w, g, op, mode) + count(f"{w}-{g}-{op}-{mode}", make(pgs[w, g], op, mode == "async")))
    time.sleep(2)  # the last dump is written by valgrind's own thread

    print(f"# instructions per op, 1 rank, {route_name()}; the floor takes the same route")
    print(f"# {'backend':8} {'group':5} {'op':14} {'mode':8} {'instr/op':>9}  dumps")
    for w, g, op, mode, k1, k2 in cases:
        per = (total(k2) - total(k1)) / (args.n2 - args.n1)
        print(f"  {w:8} {g:5} {op:14} {mode:8} {per:9.0f}  out.{k1} out.{k2}", flush=True)
    dist.destroy_process_group()
    return 0


def parts(pg, t) -> dict:
    """The fast path's parts of ``dist.broadcast(t, 0)`` on hpccomm group ``pg``:
    a callable of no arguments per label (module docstring)."""
    import torch.distributed as dist

    from hpccomm._adapters.methods import TorchOps
    from hpccomm._compat import group_of
    from hpccomm._core import execute, work
    from hpccomm._core.plan import ARGS, CALL, OUTPUTS
    from hpccomm._ops import op_path, scatter
    from hpccomm.tools.bench import floor

    g, op = group_of(pg), scatter.BROADCAST
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.asyncOp = 0, False  # (torch's options default to asyncOp=True)
    backend = pg if getattr(pg, "_g", None) is g else pg._get_backend(t.device)
    method = TorchOps.broadcast  # (the Python method torch's C++ layer calls; backend.broadcast is torch's binding)
    floor_pg = floor.new_group(None)
    if floor_pg.getBackendName() != floor.NAME:  # the Backend route: torch's ProcessGroup around the floor's Backend
        floor_pg = floor_pg._get_backend(t.device)
    floor_method = type(floor_pg).broadcast  # (its Python method, as the adapter's)
    args = ([t], 0)
    dist.broadcast(t, 0, group=pg)  # the call is checked and kept: the next ones are cached
    key = op.key(args)
    call = g.checked[key]
    fill = call.fill
    plan = fill(args)
    mpi_call, mpi_args, outputs = plan[CALL], plan[ARGS], plan[OUTPUTS]

    def empty():
        pass

    return {"dist.broadcast (all of it)": lambda: dist.broadcast(t, 0, group=pg),
            "the adapter's method": lambda: method(backend, [t], opts),
            "op_path.run": lambda: op_path.run(g, op, args, opts),
            "key": lambda: op.key(args),
            "key + cache lookup": lambda: g.checked.get(op.key(args)),
            "fill (the bound plan)": lambda: fill(args),
            "execute_bound": lambda: execute.execute_bound(g, op, call, plan),
            "the MPI call (MPI_Bcast)": lambda: mpi_call(*mpi_args),
            "work.finished": lambda: work.finished(outputs),
            "opts.rootRank": lambda: opts.rootRank,
            "getattr(opts, 'asyncOp')": lambda: getattr(opts, "asyncOp", False),
            "the floor's method": lambda: floor_method(floor_pg, [t], opts),
            "the floor's buffer": lambda: floor_pg._buf(t),
            "an empty function": empty}


if __name__ == "__main__":
    a = parse()
    sys.exit(inner(a) if a.inner else outer(a))
