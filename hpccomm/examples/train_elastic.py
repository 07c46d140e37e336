"""DDP training that survives a lost rank, in the same job (fault tolerance, MPI's ULFM).

    mpirun --with-ft ulfm -n 4 python -m hpccomm.examples.train_elastic
    mpirun --with-ft ulfm -n 4 python -m hpccomm.examples.train_elastic --kill-rank 0 --kill-step 5

An MLP learns a fixed teacher's labels from a fixed synthetic data set.
Every step trains on one global batch of ``--global-batch`` samples (the
same batches whatever the world size), split evenly over the ranks, so a
smaller world after a failure trains on the same data, each survivor taking
a bigger share.  Rank ``--kill-rank`` kills itself (SIGKILL, as a node loss
looks to the others) in the middle of step ``--kill-step``'s backward pass,
while DDP's gradient all-reduces are in flight (``--kill-rank -1``: no
simulated failure; a real one is handled the same way).

Every survivor then follows docs/fault-tolerance.md's recipe:

1. catch the failure (``hpccomm.rank_failure(exc)``: DDP's backward raises
   torch's RuntimeError around hpccomm.RankFailure),
2. ``hpccomm.shrink()``: the world without the dead rank,
3. take the new rank 0's state (step, weights, optimizer state: a survivor
   may have finished a step another did not) and wrap the model in DDP
   again over the new world,
4. go on from the next step, with the global batch split over the survivors.

Rank 0 prints the step of the failure, the time from the failure to resumed
training, and the final world size; every rank exits with status 2, saying
why, where fault tolerance is refused at init (MPICH, Intel MPI, a launch
without ``--with-ft ulfm``); at the end every rank's weights are
hashed and the program exits with status 1 on every rank unless all the
survivors hold identical weights and the loss went down.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpccomm

IN_FEATURES, CLASSES, SAMPLES = 64, 8, 8192


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m hpccomm.examples.train_elastic",
                                description="DDP training that loses a rank and goes on without it.")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--global-batch", type=int, default=240,
                   help="samples per step over all ranks (default 240: splits evenly over 1 to 6 ranks)")
    p.add_argument("--hidden", type=int, default=256, help="width of the hidden layers (default 256)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--kill-rank", type=int, default=1,
                   help="the rank that kills itself (default 1; -1: none)")
    p.add_argument("--kill-step", type=int, default=10,
                   help="the step in whose backward pass it dies (default 10)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05,
                   help="DDP's bucket size (default 0.05: several buckets in flight when the rank dies)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.global_batch < 1 or args.hidden < 1:
        p.error("--steps, --global-batch and --hidden must be at least 1")
    if args.kill_rank >= 0 and not 1 <= args.kill_step <= args.steps:
        p.error(f"--kill-step must be in 1..--steps ({args.steps})")
    return args


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def data_set():
    """The same samples and labels on every rank (a fixed teacher's argmax)."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN_FEATURES, generator=gen)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def my_share(step: int, global_batch: int, data):
    """This rank's share of step ``step``'s global batch: every size-th sample from its rank on."""
    x, y = data
    start = (step * global_batch) % (SAMPLES - global_batch)
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(start + rank, start + global_batch, size)
    return x[rows], y[rows]


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def plant_failure(model: nn.Module, args, state: dict) -> None:
    """On --kill-rank: die during step --kill-step's backward pass, when the
    first layer's gradient is ready (the last bucket DDP reduces)."""
    if dist.get_rank() != args.kill_rank:
        return

    def hook(grad):
        if state["step"] == args.kill_step:
            print(f"[rank {dist.get_rank()}] killing itself (SIGKILL) in step {state['step']}'s backward pass",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(hook)


def resync(model: nn.Module, opt, state: dict):
    """After a shrink: every survivor takes the new rank 0's step and
    optimizer state; DDP's constructor broadcasts its weights.  Returns the
    model wrapped in DDP over the new world."""
    box = [(state["step"], opt.state_dict())]
    dist.broadcast_object_list(box, src=0)
    state["step"], opt_state = box[0]
    opt.load_state_dict(opt_state)
    return DDP(model, bucket_cap_mb=state["bucket_cap_mb"])


def main(argv=None) -> int:
    args = parse(argv)
    try:
        hpccomm.init_process_group(fault_tolerance="ulfm")
    except hpccomm.InitError as exc:  # refused alike on every rank: an MPI without ULFM, a launch without the flag
        print(f"train_elastic: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    start_size = dist.get_world_size()
    if start_size > 1 and args.kill_rank >= start_size:
        say(f"--kill-rank {args.kill_rank} is not a rank of this {start_size}-rank job")
        dist.destroy_process_group()
        return 2
    if args.global_batch % start_size:
        say(f"--global-batch {args.global_batch} does not split evenly over {start_size} ranks")
        dist.destroy_process_group()
        return 2
    data = data_set()
    model = make_model(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = {"step": 0, "bucket_cap_mb": args.bucket_cap_mb}  # step: the last step completed
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    plant_failure(model, args, state)
    say(f"train_elastic: DDP over {start_size} ranks, global batch {args.global_batch}, {args.steps} steps; "
        + (f"rank {args.kill_rank} dies in step {args.kill_step}" if args.kill_rank >= 0 else "no simulated failure"))
    first_loss = last_loss = None
    failures = []
    while state["step"] < args.steps:
        done = state["step"]  # the last step whose update this rank applied
        step = done + 1
        step_began = time.perf_counter()
        try:
            x, y = my_share(step, args.global_batch, data)
            state["step"] = step  # the hook reads it
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()  # DDP averages the gradients over the world, bucket by bucket
            opt.step()
            done = step
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean)
            last_loss = mean.item() / dist.get_world_size()
            first_loss = last_loss if first_loss is None else first_loss
        except Exception as exc:  # noqa: BLE001 - a lost rank, or a real error (re-raised)
            failure = hpccomm.rank_failure(exc)
            if failure is None:
                raise
            caught = time.perf_counter()
            state["step"] = done
            old_rank = dist.get_rank()
            result = hpccomm.shrink()
            print(f"[rank {old_rank}] step {step}: {type(exc).__name__} for the failure of rank(s) "
                  f"{list(failure.ranks)} on {sorted(set(failure.hosts))}; shrunk to rank {result.rank} of "
                  f"{result.size} (failed: {list(result.ranks)})", flush=True)
            ddp = resync(model, opt, state)
            failures.append({"step": step, "caught": caught, "began": step_began, "result": result,
                             "shrunk": time.perf_counter()})
            continue
        if failures and "resumed" not in failures[-1]:
            failures[-1]["resumed"] = time.perf_counter()
            report(failures[-1])
        if step % 10 == 0 or step == args.steps:
            say(f"step {step:4d}/{args.steps}  loss {last_loss:.4f}  world size {dist.get_world_size()}")
    return finish(model, first_loss, last_loss, start_size, failures)


def report(f: dict) -> None:
    """Rank 0's line about a recovery (times measured on rank 0)."""
    r = f["result"]
    lost = ", ".join(f"rank {x.rank} on {x.host}" for x in r.failed) or "no rank"
    say(f"failure in step {f['step']}: lost {lost}; world {r.old_size} -> {r.size} ranks")
    say(f"recovery: failure caught {f['caught'] - f['began']:.3f} s after step {f['step']} began; "
        f"shrink {r.seconds:.3f} s; re-sync and DDP re-wrap {f['shrunk'] - f['caught'] - r.seconds:.3f} s; "
        f"training resumed (a step completed) {f['resumed'] - f['began']:.3f} s after step {f['step']} began, "
        f"{f['resumed'] - f['caught']:.3f} s after the failure was caught")


def finish(model, first_loss, last_loss, start_size: int, failures: list) -> int:
    size = dist.get_world_size()
    digests = [None] * size
    dist.all_gather_object(digests, digest(model))
    same = len(set(digests)) == 1
    learned = first_loss is not None and last_loss < first_loss
    say(f"final world size {size} (started with {start_size}; {len(failures)} failure(s) survived)")
    say(f"loss {first_loss:.4f} -> {last_loss:.4f}")
    if same:
        say(f"all {size} surviving ranks hold identical weights (sha256 {digests[0][:16]})")
    else:
        say(f"WEIGHTS DIFFER BETWEEN RANKS: {[d[:16] for d in digests]}")
    if not learned:
        say("THE LOSS DID NOT GO DOWN")
    dist.destroy_process_group()
    return 0 if same and learned else 1


if __name__ == "__main__":
    sys.exit(main())
