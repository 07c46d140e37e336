"""A small training run that checkpoints and resumes: the program jobs/preempt.sbatch
runs.  Copy its pattern into your own training loop.

    srun --mpi=pmix python jobs/train_resumable.py --steps 1000 --checkpoint ckpt.pt

- SIGUSR2 (from the batch script, passed on by srun) only sets a flag; the loop
  looks at it between steps, so a step is never cut in half.
- The ranks agree before stopping (an all_reduce of the flag, MAX), because the
  signal reaches them at slightly different steps; all stop at the same step.
- Rank 0 writes the checkpoint to a temporary file and renames it, so a kill
  during the write leaves the previous checkpoint intact.
- On start, every rank loads the checkpoint if there is one and goes on from
  its step.

The model is deliberately trivial and deterministic: each step adds the mean
over ranks of (rank + 1) * lr to every weight, so after N steps, however often
the run was interrupted, every weight is N * lr * (size + 1) / 2.  The last line
printed says whether that holds.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import hpccomm

stop_requested = False


def on_signal(signum, frame) -> None:
    global stop_requested
    stop_requested = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="total training steps (default 1000)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint file (shared by all nodes)")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="simulated work per step (default 0.1)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between regular checkpoints")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds any collective may take before hpccomm ends the job, naming it (default: "
                             "torch's 30 minutes)")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGUSR2, on_signal)
    hpccomm.init_process_group(timeout=None if args.timeout is None else timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    lr = 0.01
    weights = torch.zeros(8, dtype=torch.float64)
    step = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        weights, step = state["weights"], state["step"]
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    def save() -> None:
        if rank == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"weights": weights, "step": step}, tmp)
            os.replace(tmp, args.checkpoint)
        dist.barrier()  # nobody exits before the checkpoint is complete

    while step < args.steps:
        flag = torch.tensor([1 if stop_requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            save()
            if rank == 0:
                print(f"checkpointed at step {step}; exiting for requeue", flush=True)
            dist.destroy_process_group()
            return 0
        grad = torch.full_like(weights, (rank + 1) * lr)
        dist.all_reduce(grad)
        weights += grad / size
        step += 1
        time.sleep(args.step_seconds)
        if rank == 0 and step % 10 == 0:
            print(f"step {step}", flush=True)
        if step % args.checkpoint_every == 0:
            save()

    expected = args.steps * lr * (size + 1) / 2
    ok = torch.allclose(weights, torch.full_like(weights, expected))
    if rank == 0:
        print(f"done: {step} steps, weight {weights[0].item():.6f}, expected {expected:.6f}: "
              f"{'OK' if ok else 'WRONG'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
