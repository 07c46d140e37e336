"""MNIST-format data made here (no download: CI reaches PyPI only).

``write(root, n_train, n_test)`` writes the four files torchvision's
``datasets.MNIST(root)`` reads, uncompressed, where it looks for them
(``root/MNIST/raw/train-images-idx3-ubyte`` ...), so Horovod's MNIST example
finds its data and skips the download.  The images are noise plus a bright
bar whose row depends on the label, so a model can learn them.
``MNISTIdx`` reads the same files the way torchvision's MNIST with
``ToTensor()`` and ``Normalize((0.1307,), (0.3081,))`` does (for the
equivalent scripts, which run without torchvision)."""
import os
import struct

import numpy as np
import torch

FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _images_and_labels(n: int, seed: int):
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, size=n).astype(np.uint8)
    images = rng.randint(0, 64, size=(n, 28, 28)).astype(np.uint8)
    for i, label in enumerate(labels):
        images[i, 2 + 2 * label:4 + 2 * label, 4:24] = 255
    return images, labels


def write(root: str, n_train: int, n_test: int) -> str:
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for train, n, seed in ((True, n_train, 1), (False, n_test, 2)):
        images, labels = _images_and_labels(n, seed)
        img_name, lbl_name = FILES[train]
        with open(os.path.join(raw, img_name), "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        with open(os.path.join(raw, lbl_name), "wb") as f:
            f.write(struct.pack(">II", 2049, n) + labels.tobytes())
    return raw


class MNISTIdx(torch.utils.data.Dataset):
    def __init__(self, root: str, train: bool = True) -> None:
        raw = os.path.join(root, "MNIST", "raw")
        img_name, lbl_name = FILES[train]
        with open(os.path.join(raw, img_name), "rb") as f:
            _, n, rows, cols = struct.unpack(">IIII", f.read(16))
            self.images = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).view(n, rows, cols)
        with open(os.path.join(raw, lbl_name), "rb") as f:
            f.read(8)
            self.labels = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].unsqueeze(0).float().div(255)
        return x.sub_(0.1307).div_(0.3081), int(self.labels[i])
