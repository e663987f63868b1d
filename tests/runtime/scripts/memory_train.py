"""A few AdamW steps of ``Net`` under hgcli.runtime, for the memory-cap tests
(tests/runtime/test_memory_launch.py): about 1 MiB of fp32 parameters in four blocks (each an FSDP
unit), so AdamW's state (4 MiB) cannot be held by a 3 MiB emulated device, a quarter of it can."""
import torch
import torch.nn.functional as F

import hgcli.runtime as hg

STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                          for _ in range(4))
        self.head = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    ctx = hg.init()
    model = Net()
    model, opt = ctx.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(512, 256, generator=g), torch.randint(0, 4, (512,), generator=g))
    for _, (x, y) in zip(range(STEPS), ctx.shard(data, batch_size=8)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ctx.finish()


if __name__ == "__main__":
    main()
