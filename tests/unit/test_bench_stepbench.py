"""The step benchmark times a step of the runtime's loop, not a bare forward/backward/optimizer."""
from __future__ import annotations

import torch

from hgcli.node.bench.modelspec import LoadedModel
from hgcli.node.bench.step import runtime_hooks, step_samples


def test_the_timed_step_runs_the_runtimes_hooks_on_a_gathered_batch():
    model = torch.nn.Linear(3, 2)
    seen: list[torch.Tensor] = []
    hooked: list[int] = []

    def make_batch(n: int, device: object) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(n * 3, dtype=torch.float32).reshape(n, 3), torch.arange(n) % 2

    def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(targets.clone())
        hooked.append(len(model._forward_pre_hooks))     # the runtime's sample counter
        return torch.nn.functional.cross_entropy(out, targets)

    samples = list(step_samples(torch, LoadedModel(model, make_batch, loss_fn), torch.device("cpu"), (8,),
                                warmup=1, repeats=3, sync=lambda: None, memory_cap_mib=None,
                                on_batch=lambda b: None))
    assert [s.batch_size for s in samples] == [8]
    # The batch is gathered by a permutation, as runtime/data/blocks.py does: same samples, new tensor.
    assert sorted(seen[-1].tolist()) == sorted((torch.arange(8) % 2).tolist())
    assert len(seen) >= 1 + 1 + 3      # the memory accounting step, warm-up, repeats
    assert set(hooked) == {1}
    # The hooks are gone afterwards: the model is the user's again.
    assert not model._forward_pre_hooks


def test_runtime_hooks_accumulate_like_a_group_of_one():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    twin = torch.nn.Linear(4, 1)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    with runtime_hooks(model, opt, default_batch=6) as emit:
        assert opt._optimizer_step_pre_hooks and model._forward_pre_hooks   # attached while timing
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        emit(step=0, loss=1.0)            # a metrics line goes to /dev/null, never to the output
    torch.nn.functional.mse_loss(twin(x), y).backward()
    plain.step()
    # A group of one: the weighted mean of one rank's gradient is that gradient.
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert not opt._optimizer_step_pre_hooks and not model._forward_pre_hooks


def test_the_emulators_pause_falls_between_backward_and_the_optimizer():
    """As in the runtime (the emulator pauses in the optimizer's pre-hook): a pause after the
    optimizer would leave the next forward's caches cold, and that is stretched x 1/speed."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from hgcli.node.bench.timing import Clock

    events: list[str] = []
    model = torch.nn.Linear(3, 2)

    def make_batch(n: int, device: object) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(n, 3), torch.zeros(n, dtype=torch.long)

    def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        events.append("forward")
        return torch.nn.functional.cross_entropy(out, targets)

    ticks = iter(range(10_000))
    clock = Clock(now=lambda: float(next(ticks)), rest=lambda s: events.append("rest"))
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: events.append("optimizer"))
    try:
        samples = list(step_samples(torch, LoadedModel(model, make_batch, loss_fn), torch.device("cpu"), (4,),
                                    warmup=1, repeats=3, sync=lambda: None, clock=clock, memory_cap_mib=None,
                                    emulated_speed=0.5, on_batch=lambda b: None))
    finally:
        handle.remove()
    timed = events[events.index("rest") - 1:]          # from the first timed call (after accounting)
    assert timed == ["forward", "rest", "optimizer"] * 4
    # forward+backward is 1 tick of the fake clock, the optimizer 1 tick: 1 + 0.5 x 1 per call
    assert samples[0].seconds.median == 1.5


def _timed(emulated_speed: float | None, forward_ticks: list[int]) -> list[float]:
    """Seconds per timed call on a fake clock whose forward takes the given ticks, call by call."""
    from hgcli.node.bench.timing import Clock

    now = [0.0]
    ticks = iter(forward_ticks)
    model = torch.nn.Linear(3, 2)

    def make_batch(n: int, device: object) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(n, 3), torch.zeros(n, dtype=torch.long)

    def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        now[0] += next(ticks)
        return torch.nn.functional.cross_entropy(out, targets)

    clock = Clock(now=lambda: now[0])
    sample, = step_samples(torch, LoadedModel(model, make_batch, loss_fn), torch.device("cpu"), (4,),
                           warmup=2, repeats=5, sync=lambda: None, clock=clock, memory_cap_mib=None,
                           emulated_speed=emulated_speed, on_batch=lambda b: None)
    return [sample.seconds.min, sample.seconds.median, sample.seconds.max]


def test_an_emulated_step_is_timed_through_the_emulators_stable_estimate():
    """A burst on the host is not the emulated device's: below speed 1 the bench times what the
    runtime's emulator stretches (the lower quartile of recent calls), a real device its own time."""
    # the memory accounting forward, 2 warm-ups, 5 timed calls: one burst of 9 among steps of 1
    forwards = [0, 1, 1, 1, 9, 1, 1, 1]
    assert _timed(0.5, forwards) == [1.0, 1.0, 1.0]
    assert _timed(None, forwards)[2] == 9.0
