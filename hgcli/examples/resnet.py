"""A small ResNet for 3x32x32 images (written here: torchvision is not a dependency of hgtrain).

The CIFAR ResNet layout (He et al. 2016, section 4.2): a 3x3 stem, three stages of basic blocks at
16, 32 and 64 channels (the second and third halve the resolution), BatchNorm after every
convolution, global average pooling and one linear layer. ``blocks=1`` (8 layers, 78k parameters)
is what the bundled example trains; ``blocks=3`` is ResNet-20.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WIDTHS = (16, 32, 64)


class BasicBlock(nn.Module):
    """The ResNet's unit: two 3x3 convolutions with BatchNorm around a residual shortcut (a 1x1
    projection where the stride or width changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """The bundled example's model: small enough for emulated devices on a CPU, with BatchNorm buffers
    as real vision models have."""

    def __init__(self, blocks: int = 1, classes: int = 10, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        layers: list[nn.Module] = []
        c_in = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks):
                layers.append(BasicBlock(c_in, width, 2 if stage and not block else 1))
                c_in = width
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


def resnet(blocks: int = 1, seed: int = 0) -> nn.Module:
    """The model, with the same initial parameters for the same seed (every worker starts from the
    first worker's anyway: ``ctx.wrap`` and DDP broadcast them)."""
    torch.manual_seed(seed)
    return ResNet(blocks)


class Autocast(nn.Module):
    """``net`` under the autocast the example trains with (``--amp``; ``auto``: bf16 where the device
    has it natively), decided once per device type: so the bench times the step that will run (bf16
    is about twice as fast as float32 on a CPU with AMX/AVX512-BF16)."""

    def __init__(self, net: nn.Module, amp: str = "auto") -> None:
        super().__init__()
        self.net, self.amp = net, amp
        self._dtype: dict[str, torch.dtype | None] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .recipe import amp_dtype, autocast   # recipe imports the data set; only the bench needs it here

        if x.device.type not in self._dtype:
            self._dtype[x.device.type] = amp_dtype(self.amp, x.device)
        with autocast(x.device, self._dtype[x.device.type]):
            out: torch.Tensor = self.net(x)
        return out


def spec(blocks: int = 1, amp: str = "auto") -> tuple[Any, Any]:
    """The example's model in the model-spec contract of ``hgtrain bench --model`` (docs/bench.md):
    ``hgcli.examples.resnet:spec``, under the example's default autocast (``amp``). Batches are
    random images, not the data set's: bench times the step, not the data."""
    model = Autocast(resnet(blocks), amp)

    def make_batch(batch_size: int, device: Any) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(batch_size)
        inputs = torch.rand(batch_size, 3, 32, 32, generator=gen)
        targets = torch.randint(0, 10, (batch_size,), generator=gen)
        return inputs.to(device), targets.to(device)

    return model, make_batch
