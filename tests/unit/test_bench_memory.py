"""The model's memory figures of a bench (hgcli/node/bench/memory.py), on a real model's real steps."""
from __future__ import annotations

import pytest
import torch

from hgcli.node.bench.memory import model_memory, with_activations
from hgcli.node.bench.modelspec import LoadedModel
from hgcli.node.bench.step import step_samples


class Blocks(torch.nn.Module):
    """An embedding-like input layer, two blocks in a ModuleList (FSDP units), and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(128, 64)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)])
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x).relu()
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)


def test_state_units_and_activations_of_a_benched_model():
    model = Blocks()
    memory = model_memory(model)
    parameters = sum(p.numel() for p in model.parameters()) * 4
    assert memory.parameter_bytes == parameters and memory.state_bytes == 4 * parameters
    # Units: each block (64 x 64 + 64), and the root with the rest (inp and head, not the blocks): the
    # root's own is the largest.
    root = (128 * 64 + 64 + 64 * 4 + 4) * 4
    assert memory.largest_unit_bytes == root > (64 * 64 + 64) * 4 and root < memory.parameter_bytes

    def make_batch(n: int, device: object) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 128), torch.randint(0, 4, (n,))

    steps = list(step_samples(torch, LoadedModel(model, make_batch, None), torch.device("cpu"), (512, 4096),
                              warmup=0, repeats=1, sync=lambda: None, memory_cap_mib=None, on_batch=lambda b: None))
    measured = with_activations(memory, steps)
    assert [a.batch_size for a in measured.activations] == [512, 4096]
    small, large = (a.bytes for a in measured.activations)
    # The hidden activations alone (three 64-wide layers, relu outputs saved) of 4096 samples are
    # over 3 MiB; the peak (counted in whole MiB) less the state grows with the batch.
    assert large > small >= 0 and large >= 3 * 4096 * 64 * 4
    assert measured.activation_bytes(4096) == pytest.approx(large) and measured.least_bytes() >= 2 * root


def test_the_node_bench_puts_the_figures_in_the_device_profile():
    from tests.unit.test_bench_node import cpu_bench, profile_of      # one bench per session, shared

    p = profile_of(cpu_bench())
    parameters = (784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10) * 4
    m = p.memory
    # mlp has no ModuleList: the root is its one unit, holding every parameter.
    assert (m.parameter_bytes, m.state_bytes, m.largest_unit_bytes) == (parameters, 4 * parameters, parameters)
    assert [a.batch_size for a in m.activations] == [s.batch_size for s in p.steps] == [4, 16, 64, 256]
    assert all(a.bytes == max(0, (s.memory_mib << 20) - 3 * parameters) for a, s in zip(m.activations, p.steps))
    assert m.activations[-1].bytes > m.activations[0].bytes
