"""The program tests/test_slurm.py runs inside the SLURM jobs: it reports where
each rank sits and runs collectives across the nodes.

    srun --mpi=pmix python tests/slurm/check_job.py            # hpccomm (MPI launch)
    torchrun ... tests/slurm/check_job.py --backend gloo       # torchrun's workers

Rank 0 prints one line ``CHECK_JOB {json}`` with every rank's view and the
collective results; the test compares them with closed forms.
"""
from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="hpccomm", choices=["hpccomm", "gloo"])
    args = parser.parse_args()
    if args.backend == "hpccomm":
        import hpccomm

        hpccomm.init_process_group()
        local_rank, local_size, node = hpccomm.local_rank(), hpccomm.local_size(), hpccomm.node_index()
    else:  # torchrun: its environment says where each worker sits
        dist.init_process_group("gloo")
        local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        node = int(os.environ["GROUP_RANK"])
    rank, size = dist.get_rank(), dist.get_world_size()
    view = {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size, "node": node,
            "slurm_node": os.environ.get("SLURMD_NODENAME"), "slurm_nodeid": os.environ.get("SLURM_NODEID"),
            "host": socket.gethostname()}
    views = [None] * size
    dist.all_gather_object(views, view)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # across every rank of every node
    # One rank per node: a group across the nodes, summing node indices.
    leaders = sorted(v["rank"] for v in views if v["local_rank"] == 0)
    group = dist.new_group(leaders)
    across = None
    if rank in leaders:
        t = torch.tensor([float(node + 1)])
        dist.all_reduce(t, group=group)
        across = t.item()
    acrosses = [None] * size
    dist.all_gather_object(acrosses, across)
    if rank == 0:
        print("CHECK_JOB " + json.dumps({"views": views, "all_reduce": total.item(), "leaders": leaders,
                                         "across_nodes": [a for a in acrosses if a is not None]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
