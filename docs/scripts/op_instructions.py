"""Instructions per op of hpccomm and of the floor, counted by valgrind's callgrind (docs/benchmarks.md).

    python docs/scripts/op_instructions.py                        # every case, this torch, hpccomm's default route
    HPCCOMM_ADAPTER=backend python docs/scripts/op_instructions.py   # the c10d Backend route (torch >= 2.14)
    python docs/scripts/op_instructions.py --ops all_reduce --modes async --which hpccomm --keep DIR

One rank (no launcher needed: hpccomm starts a world of one), one process under callgrind for all
cases: per case a warm-up, then instrumentation on around N1 and then N2 ops (each dumped), and
instructions/op = (count(N2) - count(N1)) / (N2 - N1), which cancels the switching itself.  A
count, unlike a time, does not move with the machine's load.  sendrecv on one rank is a send to
itself and a receive from itself (torch refuses a blocking send to self: ``isend`` then a blocking
``recv``, then the send's ``wait``), two ops.  The floor takes hpccomm's route.  ``--keep DIR``
keeps the dumps (``callgrind_annotate DIR/out.K``; the table names each case's K).
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

    def control(*what):
        subprocess.run(["callgrind_control", *what, pid], capture_output=True)

    cases, dump = [], 0
    for op in args.ops.split(","):
        for mode in args.modes.split(","):
            for g in groups:
                for w in which:
                    one = make(pgs[w, g], op, mode == "async")
                    for _ in range(args.warmup):
                        one()
                    for count in (args.n1, args.n2):
                        control("-z")
                        control("-i", "on")
                        for _ in range(count):
                            one()
                        control("-i", "off")
                        control(f"--dump={w}-{g}-{op}-{mode}-{count}")
                        dump += 1
                    cases.append((w, g, op, mode, dump - 1, dump))
    time.sleep(0.5)  # the last dump is written by valgrind's own thread

    def total(k):
        with open(f"{args.inner}/out.{k}") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("totals:"))

    print(f"# instructions per op, 1 rank, {route_name()}; the floor takes the same route")
    print(f"# {'backend':8} {'group':5} {'op':14} {'mode':8} {'instr/op':>9}  dumps")
    for w, g, op, mode, k1, k2 in cases:
        per = (total(k2) - total(k1)) / (args.n2 - args.n1)
        print(f"  {w:8} {g:5} {op:14} {mode:8} {per:9.0f}  out.{k1} out.{k2}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    a = parse()
    sys.exit(inner(a) if a.inner else outer(a))
