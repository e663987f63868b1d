"""The data and network of the Lightning and accelerate test scripts, and the tests' reference: one
process's SGD over the union of the ranks' batches, step by step."""
import torch

N, FEATURES, LR = 384, 8, 0.05


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEATURES, generator=gen)
    return x, x @ torch.randn(FEATURES, 1, generator=gen) + 0.1 * torch.randn(N, 1, generator=gen)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def one_process(steps: list[list[int]], accumulate: int = 1) -> list[torch.Tensor]:
    """The parameters after SGD on each step's samples ``steps[k]`` as one batch, stepping once per
    ``accumulate`` steps on their gradients' mean (as Lightning's ``accumulate_grad_batches``)."""
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for k, index in enumerate(steps):
        (torch.nn.functional.mse_loss(model(x[index]), y[index]) / accumulate).backward()
        if (k + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return [p.detach().flatten() for p in model.parameters()]
