"""Where a small op's time over the floor goes: Python bytecodes per function, and time against instructions
(docs/benchmarks.md, "Each op declared once": "Where the time over the floor goes").

    python docs/scripts/op_time_split.py opcodes [--ops all_reduce,broadcast]   # one rank, no launcher
    mpirun -n 2 python docs/scripts/op_time_split.py time [--rounds 31]           # any number of ranks

``opcodes``: callgrind counts instructions but sees the interpreter, not the Python functions
(docs/scripts/op_instructions.py); this counts the bytecodes each Python function executes per
repeated blocking op (``sys.settrace`` with opcode events, 100 ops after a warm-up), for hpccomm and
for the floor (hpccomm.tools.bench.floor, the thinnest Python process group on the same torch route),
so the functions a faster path would have to shorten are named.  The counts do not depend on the
machine.

``time``: a blocking 8-byte all_reduce of hpccomm and of the floor, back to back, two ways: in blocks
of 1000 ops per backend (``blocks``), and the two backends taking turns op by op (``turns``: each
one's code and data leave the caches to the other's, as in ``hpccomm bench``); the median over
``--rounds`` of rank 0's time per op and the gap as a share of the floor's time, to set beside the
instruction gap (op_instructions.py).  Run it with the options to compare (``HPCCOMM_MISMATCH_CHECK``,
``HPCCOMM_FR_BUFFER_SIZE``) set alike on every rank.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings


def _setup():
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import hpccomm
    from hpccomm.tools.bench import floor

    hpccomm.init_process_group()
    return torch, dist, floor.new_group(None)


def _calls(torch, dist, pg):
    n = dist.get_world_size()
    t, o1, out, inp = torch.ones(2), torch.empty(2), torch.empty(2 * n), torch.ones(2 * n)
    return {"all_reduce": lambda: dist.all_reduce(t, group=pg),
            "broadcast": lambda: dist.broadcast(t, 0, group=pg),
            "all_gather": lambda: dist.all_gather_into_tensor(out, t, group=pg),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(o1, inp, group=pg)}


def opcodes(args) -> int:
    torch, dist, fl = _setup()
    n_ops = 100
    for op in args.ops.split(","):
        for name, pg in (("hpccomm", None), ("floor", fl)):
            one = _calls(torch, dist, pg)[op]
            for _ in range(3000):
                one()
            count = collections.Counter()

            def trace(frame, event, arg):
                frame.f_trace_opcodes = True
                if event == "opcode":
                    code = frame.f_code
                    where = code.co_filename.split("site-packages/")[-1].split("hpccomm/", 1)[-1]
                    count[f"{where}:{code.co_firstlineno} {code.co_name}"] += 1
                return trace

            sys.settrace(trace)
            for _ in range(n_ops):
                one()
            sys.settrace(None)
            mine = {k: v for k, v in count.items() if "torch/" not in k and __file__ not in k}
            print(f"# {op}, {name}: {sum(count.values()) / n_ops:.0f} bytecodes per op, "
                  f"{sum(mine.values()) / n_ops:.0f} in the backend's own functions")
            for k, v in sorted(mine.items(), key=lambda kv: -kv[1]):
                print(f"  {v / n_ops:6.0f}  {k}")
    dist.destroy_process_group()
    return 0


def timing(args) -> int:
    torch, dist, fl = _setup()
    from hpccomm import _mpi

    barrier = _mpi.mpi().COMM_WORLD.Barrier
    pc = time.perf_counter
    backends = (("hpccomm", _calls(torch, dist, None)["all_reduce"]), ("floor", _calls(torch, dist, fl)["all_reduce"]))
    for _, one in backends:
        for _ in range(2000):
            one()
    rows = {}
    for way in ("blocks", "turns"):
        per = {name: [] for name, _ in backends}
        for _ in range(args.rounds):
            barrier()
            if way == "blocks":
                for name, one in backends:
                    t0 = pc()
                    for _ in range(1000):
                        one()
                    per[name].append((pc() - t0) * 1e3)
            else:
                spent = dict.fromkeys(per, 0.0)
                for _ in range(1000):
                    for name, one in backends:
                        t0 = pc()
                        one()
                        spent[name] += pc() - t0
                for name in per:
                    per[name].append(spent[name] * 1e3)
        rows[way] = {name: statistics.median(v) for name, v in per.items()}
    if dist.get_rank() == 0:
        env = " ".join(f"{k}={os.environ[k]}" for k in ("HPCCOMM_MISMATCH_CHECK", "HPCCOMM_FR_BUFFER_SIZE")
                       if k in os.environ) or "defaults"
        for way, m in rows.items():
            gap = m["hpccomm"] - m["floor"]
            print(f"ranks={dist.get_world_size()} {env} {way}: hpccomm {m['hpccomm']:.2f} us, floor "
                  f"{m['floor']:.2f} us, gap {gap:.2f} us ({gap / m['floor'] * 100:.0f} % of the floor)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("opcodes", "time"))
    p.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter")
    p.add_argument("--rounds", type=int, default=31)
    a = p.parse_args()
    sys.exit(opcodes(a) if a.what == "opcodes" else timing(a))
