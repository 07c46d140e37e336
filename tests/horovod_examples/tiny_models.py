"""Small image classifiers for the synthetic-benchmark equivalent, named like
torchvision's model constructors (``getattr(models, name)()``), so the
equivalent runs where torchvision cannot be installed (CI's CPU torch).
They take 3x224x224 images and give 1000 logits, as torchvision's do."""
import torch
from torch import nn


class _TinyResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, kernel_size=7, stride=4, padding=3)
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=1))
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(width * 16, classes)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(x + self.block(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class models:  # noqa: N801 - stands in for the torchvision.models module
    @staticmethod
    def resnet_tiny():
        return _TinyResNet(8)

    @staticmethod
    def resnet_small():
        return _TinyResNet(16)
