# EQUIVALENT, NOT HOROVOD'S FILE. Written for hpccomm's tests to do what Horovod's
# examples/pytorch/pytorch_synthetic_benchmark.py does (same flags, same Horovod calls
# in the same order, same output lines), because Horovod's examples are not in any
# package on PyPI (its sdist leaves examples/ out) and CI reaches PyPI only.  The one
# deliberate difference: models come from tests/horovod_examples/tiny_models.py, not
# torchvision (no CPU torchvision wheel on PyPI).  The test runner rewrites the import
# line below to `import hpccomm.horovod as hvd`, as it does for Horovod's real file.
import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim
from tiny_models import models
import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (equivalent)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="fp16 compression in allreduce")
parser.add_argument("--model", type=str, default="resnet_tiny", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="warm-up batches, not timed")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use the Adasum reduction")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())

model = getattr(models, args.model)()
lr_scaler = hvd.size() if not args.use_adasum else 1
if args.cuda:
    model.cuda()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 224, 224)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(text):
    if hvd.rank() == 0:
        print(text)


device = "GPU" if args.cuda else "CPU"
log("Model: %s" % args.model)
log("Batch size: %d" % args.batch_size)
log("Number of %ss: %d" % (device, hvd.size()))
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / seconds
    log("Iter #%d: %.1f img/sec per %s" % (x, img_sec, device))
    img_secs.append(img_sec)
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log("Img/sec per %s: %.1f +-%.1f" % (device, img_sec_mean, img_sec_conf))
log("Total img/sec on %d %s(s): %.1f +-%.1f" % (hvd.size(), device, hvd.size() * img_sec_mean,
                                               hvd.size() * img_sec_conf))
