"""Models the benchmark and the examples use when the user names none.

``mlp`` follows the model-spec contract of ``hgtrain bench --model`` (see docs/bench.md): a factory
returning the model and a batch maker. torch is imported inside the factory so the controller can
import this module (for the layer sizes) without torch.
"""
from __future__ import annotations

from typing import Any

# An MNIST-shaped classifier: small enough to bench in seconds on a CPU, big enough that its step
# time grows with the batch.
MLP_SIZES = (784, 512, 512, 10)


def mlp() -> tuple[Any, Any]:
    import torch

    layers: list[Any] = []
    for i, (fan_in, fan_out) in enumerate(zip(MLP_SIZES, MLP_SIZES[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    model = torch.nn.Sequential(*layers)

    def make_batch(batch_size: int, device: Any) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(batch_size)
        inputs = torch.randn(batch_size, MLP_SIZES[0], generator=gen)
        targets = torch.randint(0, MLP_SIZES[-1], (batch_size,), generator=gen)
        return inputs.to(device), targets.to(device)

    return model, make_batch


def example(hidden: int = 128) -> tuple[Any, Any]:
    """The model ``hgcli.examples.train_mlp`` trains (same layers and input shape), in the model-spec
    contract, so ``bench --model`` can time exactly what that example trains (see
    benchmarks/cost_model_accuracy.py; other hidden sizes through a one-line factory file). The
    README's main job, ``hgcli.examples.train``, trains the ResNet of ``hgcli.examples.resnet:spec``."""
    import torch

    from .data import CLASSES, FEATURES, make_model

    model = make_model(hidden=hidden)

    def make_batch(batch_size: int, device: Any) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(batch_size)
        inputs = torch.randn(batch_size, FEATURES, generator=gen)
        targets = torch.randint(0, CLASSES, (batch_size,), generator=gen)
        return inputs.to(device), targets.to(device)

    return model, make_batch
