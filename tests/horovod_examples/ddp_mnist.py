# The MNIST example written for plain DDP on hpccomm: the same model, data, seeds,
# learning rate and steps as pytorch_mnist.py (Horovod's or the equivalent), with
# torch.distributed calls where it has Horovod calls.  The test runner compares
# the weights both leave.  Data: torchvision's MNIST reader when
# HOROVOD_EXAMPLE_DATA=torchvision (for Horovod's file), else mnist_idx.MNISTIdx.
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.nn.parallel import DistributedDataParallel as DDP

import hpccomm

parser = argparse.ArgumentParser(description="PyTorch MNIST Example, DDP on hpccomm")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--data-dir")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def datasets(root):
    if os.environ.get("HOROVOD_EXAMPLE_DATA") == "torchvision":
        from torchvision import datasets as tv, transforms

        t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        return tv.MNIST(root, train=True, transform=t), tv.MNIST(root, train=False, transform=t)
    from mnist_idx import MNISTIdx

    return MNISTIdx(root, train=True), MNISTIdx(root, train=False)


def main(args):
    hpccomm.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = datasets(args.data_dir or "./data")
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=size, rank=rank)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=size, rank=rank)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    model = DDP(model)
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        model.eval()
        for _ in test_loader:  # the same draws from torch's generator as the Horovod script's test()
            pass
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parser.parse_args())
