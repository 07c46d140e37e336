"""Train a model with DistributedDataParallel (or FSDP2) on hpccomm (or gloo, to compare).

    mpirun -n 4 python -m hpccomm.examples.train_ddp
    mpirun -n 2 python -m hpccomm.examples.train_ddp --bench --backend both
    mpirun -n 2 python -m hpccomm.examples.train_ddp --bench --backend both --parallel both

An MLP classifier learns a random teacher network's labels from synthetic
data, each rank drawing its own batches.  Rank 0 shows the loss (the mean
over ranks) and samples/s: one line updated in place on a terminal, one line
every ``--print-every`` steps otherwise (a log file, a pipe: also when
``mpirun``'s output goes there, though it gives each rank a pseudo-terminal).
At the end every rank hashes its weights, the hashes are gathered, and the
program prints that all ranks hold identical weights, or exits with status 1
if they do not.

``--backend gloo`` trains over a gloo group made in the same launch
(``dist.new_group(backend="gloo")``, rendezvous through hpccomm's store),
``--backend both`` trains once on each; ``--bench`` then prints the mean
step time after ``--warmup`` steps and, with ``both``, the ratio.
``--parallel fsdp`` shards the same model with FSDP2 (``fully_shard`` per
layer, on a 1-D device mesh of the backend's group: ``init_device_mesh``,
with ``backend_override`` for gloo) instead of wrapping it in DDP;
``--parallel both`` trains each way (lines and figures of FSDP2 runs say
``fsdp2``).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpccomm

from ._common import output_is_terminal, rank0s, say, start

IN_FEATURES, CLASSES = 256, 16


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m hpccomm.examples.train_ddp",
                                description="DDP training on synthetic data, hpccomm or gloo.")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers (default 1024)")
    p.add_argument("--layers", type=int, default=3, help="hidden layers (default 3)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--backend", choices=("hpccomm", "gloo", "both"), default="hpccomm",
                   help="the group DDP reduces gradients over (default hpccomm)")
    p.add_argument("--parallel", choices=("ddp", "fsdp", "both"), default="ddp",
                   help="DistributedDataParallel (default), FSDP2 (fully_shard), or each in turn")
    p.add_argument("--bench", action="store_true", help="print the mean step time after --warmup steps")
    p.add_argument("--warmup", type=int, default=5, help="steps not timed with --bench (default 5)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size (default 25, DDP's)")
    p.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="bar: one line updated in place; lines: a line every --print-every steps; "
                        "auto (default): bar when rank 0's output reaches a terminal (under mpirun: when "
                        "mpirun's own output does), else lines")
    p.add_argument("--print-every", type=int, default=0,
                   help="with --progress lines, a line every N steps (default: steps/10)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --bench, train this many times per backend, alternating backends, "
                        "and report the mean (default 1)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (default: cores / ranks on this node, at least 1)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.hidden < 1 or args.layers < 1:
        p.error("--steps, --batch-size, --hidden and --layers must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.bench and args.steps <= args.warmup:
        p.error(f"--bench needs --steps ({args.steps}) greater than --warmup ({args.warmup})")
    return args


def make_model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    dims = [IN_FEATURES] + [hidden] * layers
    body = []
    for a, b in zip(dims, dims[1:]):
        body += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*body, nn.Linear(dims[-1], CLASSES))


class Data:
    """Synthetic classification: labels are a fixed random teacher's argmax.
    Each rank draws its own batches (seeded by rank)."""

    def __init__(self, rank: int, batch: int) -> None:
        teacher_gen = torch.Generator().manual_seed(1234)
        self.teacher = torch.randn(IN_FEATURES, CLASSES, generator=teacher_gen)
        self.gen = torch.Generator().manual_seed(10_000 + rank)
        self.batch = batch

    def next(self):
        x = torch.randn(self.batch, IN_FEATURES, generator=self.gen)
        return x, (x @ self.teacher).argmax(dim=1)


class Progress:
    """Rank 0's progress display: ``\\r``-updated on a terminal, else a line every ``every`` steps
    (a batch job's log then holds one line per report, not every update in one line)."""

    def __init__(self, steps: int, every: int, label: str, mode: str) -> None:
        self.tty = mode == "bar"
        self.steps, self.every, self.label = steps, every, label
        self.rank0 = dist.get_rank() == 0

    def wants(self, step: int) -> bool:
        return self.tty or step == 1 or step % self.every == 0 or step == self.steps

    def show(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.rank0:
            return
        width = 24
        done = width * step // self.steps
        bar = "#" * done + "." * (width - done)
        line = f"{self.label} [{bar}] step {step:4d}/{self.steps}  loss {loss:.4f}  {samples_per_s:10,.0f} samples/s"
        if self.tty:
            print("\r" + line, end="\n" if step == self.steps else "", flush=True)
        else:
            print(line, flush=True)


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        if hasattr(t, "full_tensor"):  # an FSDP2 shard (a DTensor): the whole parameter, as DDP holds it
            t = t.full_tensor()
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def wrap(args, model: nn.Module, backend: str, group, fsdp: bool):
    """``(model made data-parallel, its group)``: DDP over ``group``, or FSDP2
    on a 1-D mesh of the backend (the mesh's group)."""
    if not fsdp:
        return DDP(model, process_group=group, bucket_cap_mb=args.bucket_cap_mb), group
    from hpccomm._compat import fully_shard as _fully_shard

    fully_shard = _fully_shard()
    override = {} if backend == "hpccomm" else {"backend_override": {0: backend}}
    mesh = dist.init_device_mesh("cpu", (dist.get_world_size(),), **override)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh), mesh.get_group()


def train(args, backend: str, group, fsdp: bool = False) -> dict:
    """One training run with DDP (or FSDP2) over ``group``: its step times and verdict."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(args.hidden, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    label = backend + (" fsdp2" if fsdp else "")
    ddp, group = wrap(args, model, backend, group, fsdp)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    data = Data(rank, args.batch_size)
    every = args.print_every or max(args.steps // 10, 1)
    progress = Progress(args.steps, every, f"{label:7s}", args.progress)
    say(f"{label}: {'FSDP2' if fsdp else 'DDP'} over {size} rank(s), {n_params:,} parameters "
        f"({n_params * 4 / 2**20:.1f} MiB of gradients per step), batch {args.batch_size} per rank")
    times, losses = [], []
    for step in range(1, args.steps + 1):
        x, y = data.next()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()  # DDP averages the gradients over the group, bucket by bucket
        opt.step()
        times.append(time.perf_counter() - t0)
        if progress.wants(step):  # outside the timed region: the display's own all_reduce
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean, group=group)
            losses.append(mean.item() / size)
            recent = times[-every:] if not progress.tty else times[-10:]
            progress.show(step, losses[-1], args.batch_size * size / statistics.mean(recent))
    digests = [None] * size
    dist.all_gather_object(digests, weights_digest(model), group=group)
    same = len(set(digests)) == 1
    say(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    if same:
        say(f"{label}: all {size} ranks hold identical weights (sha256 {digests[0][:16]})")
    else:
        say(f"{label}: WEIGHTS DIFFER BETWEEN RANKS: {[d[:16] for d in digests]}")
    return {"times": times, "same": same, "first_loss": losses[0], "last_loss": losses[-1], "group": group}


def step_stats(times: list, warmup: int, group) -> tuple:
    """Mean and stdev of the step time after warmup, the slowest rank's (max over ranks)."""
    timed = times[warmup:]
    t = torch.tensor([statistics.mean(timed), statistics.pstdev(timed)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t[0].item(), t[1].item(), len(timed)


def main(argv=None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
    rank, size = start()
    if args.progress == "auto":  # rank 0's output decides; every rank follows (the bar reduces the loss each step)
        args.progress = "bar" if rank0s(output_is_terminal()) else "lines"
    threads = args.threads or max(1, (os.cpu_count() or 1) // hpccomm.local_size())
    torch.set_num_threads(threads)
    say(f"hpccomm {hpccomm.__version__}: {size} rank(s), {threads} torch thread(s) per rank")
    groups = {"hpccomm": None}
    if args.backend in ("gloo", "both"):
        groups["gloo"] = dist.new_group(backend="gloo")  # every rank calls new_group
    backends = ["hpccomm", "gloo"] if args.backend == "both" else [args.backend]
    ways = {"ddp": [False], "fsdp": [True], "both": [False, True]}[args.parallel]
    rounds = args.rounds if args.bench else 1
    results = {(b, f): [] for b in backends for f in ways}
    for fsdp in ways:
        for _ in range(rounds):  # alternating, so a change in machine load hits both backends alike
            for b in backends:
                results[b, fsdp].append(train(args, b, groups[b], fsdp))
    status = 0 if all(r["same"] for runs in results.values() for r in runs) else 1
    if args.bench:
        for fsdp in ways:
            tag = " fsdp2" if fsdp else ""
            means = {}
            for b in backends:
                stats = [step_stats(r["times"], args.warmup, r["group"]) for r in results[b, fsdp]]
                mean = statistics.mean(s[0] for s in stats)
                std = statistics.mean(s[1] for s in stats)
                means[b] = mean
                say(f"bench {b}{tag}: mean step time {mean * 1e3:.2f} ms (stdev {std * 1e3:.2f} ms, slowest rank, "
                    f"{rounds} x {stats[0][2]} steps after {args.warmup} warmup), "
                    f"{args.batch_size * size / mean:,.0f} samples/s")
            if len(means) == 2:
                say(f"bench{tag}: hpccomm/gloo step time ratio {means['hpccomm'] / means['gloo']:.2f} "
                    f"({size} ranks, hidden {args.hidden}, layers {args.layers}, batch {args.batch_size})")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
