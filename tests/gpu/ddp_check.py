"""DDP on a CUDA model over hpccomm: the weights equal a one-process run on
the world's batches, identical on every rank; the step time against gloo's
CUDA path (tests/gpu/check.sh runs it under the launcher).

    mpirun -n 2 python tests/gpu/ddp_check.py [--steps 30] [--hidden 1024] [--json FILE]

A small MLP (about 3 million parameters at --hidden 1024), SGD, each rank
training on its own batch; after the steps every rank holds the weights one
process gets by training on the concatenation of every rank's batches (DDP
averages the gradients), within float32 rounding.  Then the same training is
timed with hpccomm and with gloo (a group of each over the same ranks).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import hpccomm


def model(hidden: int, device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 256)).to(device)


def batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 256, generator=g)
    return x.to(device), (x * 0.5).to(device)


def train(net, steps: int, ranks, device, timed=False):
    """``steps`` of SGD on the batches of ``ranks`` (one rank's: DDP; every
    rank's: the one-process reference); the median step time when ``timed``."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        parts = [batch(step, r, device) for r in ranks]
        x, y = torch.cat([q[0] for q in parts]), torch.cat([q[1] for q in parts])
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) if timed and len(times) > 3 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ddp_check: no GPU (torch.cuda.is_available() is False): nothing run", file=sys.stderr)
        return 2
    hpccomm.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    ddp = torch.nn.parallel.DistributedDataParallel(model(args.hidden, device))
    train(ddp, args.steps, [rank], device)
    ref = model(args.hidden, device)
    train(ref, args.steps, range(n), device)  # one process on every rank's batch: DDP averages the gradients
    diff = max((a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), ref.parameters()))
    digest = hashlib.sha256(b"".join(q.detach().cpu().numpy().tobytes() for q in ddp.module.parameters()))
    digests = hpccomm.mpi_comm().allgather(digest.hexdigest())
    params = sum(q.numel() for q in ref.parameters())
    timing = {}
    for backend in ("hpccomm", "gloo"):
        pg = dist.new_group(backend=backend)
        net = torch.nn.parallel.DistributedDataParallel(model(args.hidden, device), process_group=pg)
        timing[backend] = train(net, args.steps, [rank], device, timed=True)
        dist.barrier()
    ok = diff <= 2e-5 and len(set(digests)) == 1
    result = {"ranks": n, "parameters": params, "max_weight_difference": diff, "identical_on_every_rank":
              len(set(digests)) == 1, "step_ms": {b: t * 1e3 for b, t in timing.items()},
              "routes": hpccomm.gpu.routes(), "ok": ok}
    if rank == 0:
        print(f"ddp_check: {n} ranks, {params} parameters, weights {'equal' if ok else 'NOT equal'} to the "
              f"one-process run (max difference {diff:.3g}), identical on every rank: {len(set(digests)) == 1}; "
              f"step {timing['hpccomm'] * 1e3:.2f} ms with hpccomm, {timing['gloo'] * 1e3:.2f} ms with gloo "
              f"({timing['hpccomm'] / timing['gloo']:.2f}x); routes {hpccomm.gpu.routes()}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
