"""Would a lagged mismatch check cost less than the every-call check? (docs/benchmarks.md, "The every-call check")

    mpirun -n 2 python docs/scripts/lagged_check_cost.py [--rounds 15] [--repeat 2000]

Issue 36 allows, where comparing every call before it runs costs more than one raw 8-byte allreduce, a
cheaper default that still catches every mismatch within a bounded number of ops.  The only cheaper
candidate is to exchange op k's fingerprint beside op k, without waiting for it, and to learn the
verdict at a later op.  This measures what MPI itself charges for each way, with no hpccomm and no
torch in the loop: the user's op is a blocking 8-byte ``MPI_Allreduce`` on one communicator; the
check, a 56-byte sum of fingerprints on another, taken

- ``none``: no check (the op alone);
- ``blocking``: ``Allreduce`` of the 56 bytes before each op (hpccomm's ``every``);
- ``lag 1``: ``Iallreduce`` posted before each op, waited for before the next one is posted (the
  verdict of op k at op k+1);
- ``lag 8``: the same, with up to 8 exchanges in flight, each tested (``Test``) at every op and waited
  for only when it is 8 ops old (the verdict within 8 ops).

Blocks of ``--repeat`` ops take turns in an order that rotates every round; the figures are medians
over the rounds of the slowest rank's time per op (µs), and each way's cost over ``none``.  The
Python around the MPI calls is what any implementation needs at least (a request kept, a slice
compared), so a way that costs more here costs more in hpccomm too.
"""
from __future__ import annotations

import argparse
import statistics
import struct
import time
from collections import deque

import numpy as np
from mpi4py import MPI

WAYS = ("none", "blocking", "lag 1", "lag 8")


def block(way: str, comm, check, repeat: int) -> float:
    """Seconds per op of ``repeat`` ops taken ``way``."""
    sbuf, rbuf = np.ones(2, dtype=np.float32), np.empty(2, dtype=np.float32)
    n = comm.Get_size()
    sent = struct.pack("7Q", *range(7))
    want = struct.pack("7Q", *(n * k for k in range(7)))
    boxes = [bytearray(56) for _ in range(9)]  # (as hpccomm's check: bytes in, bytes compared)
    specs = [[box, 7, MPI.UINT64_T] for box in boxes]
    pending: deque = deque()
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(repeat):
        if way == "blocking":
            box = boxes[0]
            box[:] = sent
            check.Allreduce(MPI.IN_PLACE, specs[0], MPI.SUM)
            if box != want:
                raise SystemExit("mismatch")
        elif way != "none":
            lag = 1 if way == "lag 1" else 8
            while pending and (len(pending) >= lag or pending[0][0].Test()):
                req, box = pending.popleft()
                req.Wait()
                if box != want:
                    raise SystemExit("mismatch")
            box = boxes[i % 9]
            box[:] = sent
            pending.append((check.Iallreduce(MPI.IN_PLACE, specs[i % 9], MPI.SUM), box))
        comm.Allreduce(sbuf, rbuf, MPI.SUM)
    while pending:
        req, box = pending.popleft()
        req.Wait()
    elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--repeat", type=int, default=2000)
    args = p.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    check = MPI.COMM_WORLD.Dup()
    times = {way: [] for way in WAYS}
    for way in WAYS:
        block(way, comm, check, 200)  # warm-up
    for r in range(args.rounds):
        order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
        for way in order:
            times[way].append(block(way, comm, check, args.repeat))
    if comm.Get_rank() == 0:
        name = MPI.Get_library_version().splitlines()[0][:60]
        print(f"# {comm.Get_size()} ranks, {name}; median of {args.rounds} rounds of {args.repeat} ops, µs per op")
        base = statistics.median(times["none"]) * 1e6
        for way in WAYS:
            med = statistics.median(times[way]) * 1e6
            print(f"{way:>9} {med:8.2f}  {'+' if med >= base else ''}{med - base:.2f}")


if __name__ == "__main__":
    main()
