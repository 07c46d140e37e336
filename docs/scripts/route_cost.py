"""Per-op cost of torch's route, one rank (docs/benchmarks.md, "The op path on each torch route").

    python docs/scripts/route_cost.py                                  # hpccomm's default route
    HPCCOMM_ADAPTER=backend python docs/scripts/route_cost.py          # the c10d Backend route
    TORCH_FR_BUFFER_SIZE=0 HPCCOMM_ADAPTER=backend python docs/scripts/route_cost.py   # without torch's flight recorder

Times a blocking 1 KiB float32 ``dist.all_reduce`` on hpccomm's default group and on the floor (the
thinnest Python backend, on the same route), in a world of one rank (no launcher: no communication,
only the path): the median over 30 samples of 500 back-to-back ops, after 300 warm-up ops.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

import hpccomm
from hpccomm.tools.bench import floor

hpccomm.init_process_group()
t = torch.ones(256)
result = {}
for name, group in (("hpccomm", None), ("floor", floor.new_group(None))):
    for _ in range(300):
        dist.all_reduce(t, group=group)
    samples = []
    for _ in range(30):
        t0 = time.perf_counter()
        for _ in range(500):
            dist.all_reduce(t, group=group)
        samples.append((time.perf_counter() - t0) / 500 * 1e6)
    result[name] = statistics.median(samples)
    assert torch.equal(t, torch.ones(256)), "a 1-rank all_reduce changed its tensor"
print(f"torch {torch.__version__.split('+')[0]}, route {floor.route_of()}, "
      f"TORCH_FR_BUFFER_SIZE={os.environ.get('TORCH_FR_BUFFER_SIZE', 'unset')}: "
      + ", ".join(f"{k} {v:.2f} µs" for k, v in result.items())
      + f", hpccomm - floor {result['hpccomm'] - result['floor']:.2f} µs")
dist.destroy_process_group()
