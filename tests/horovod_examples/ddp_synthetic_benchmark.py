# The synthetic benchmark written for plain DDP on hpccomm: the same model, data,
# learning rate and steps as pytorch_synthetic_benchmark.py (Horovod's or the
# equivalent), with torch.distributed calls where it has Horovod calls.  The test
# runner compares the weights both leave after the same steps.  Models come from
# the module named by HOROVOD_EXAMPLE_MODELS (torchvision.models for Horovod's
# file, tiny_models for the equivalent).
import argparse
import importlib
import os
import timeit

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import hpccomm

source = os.environ.get("HOROVOD_EXAMPLE_MODELS", "tiny_models")
models = importlib.import_module(source)
models = getattr(models, "models", models)  # tiny_models.models, or the torchvision.models module

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark, DDP on hpccomm")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--model", type=str, default="resnet_tiny")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
args = parser.parse_args()

hpccomm.init_process_group()
model = getattr(models, args.model)()
optimizer = optim.SGD(model.parameters(), lr=0.01 * dist.get_world_size())
model = DDP(model)  # broadcasts rank 0's parameters and buffers, as broadcast_parameters does
if args.fp16_allreduce:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
data = torch.randn(args.batch_size, 3, 224, 224)
target = torch.LongTensor(args.batch_size).random_() % 1000


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


timeit.timeit(benchmark_step, number=args.num_warmup_batches)
for _ in range(args.num_iters):
    timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
dist.destroy_process_group()
