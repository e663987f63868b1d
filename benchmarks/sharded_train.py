"""The training script of benchmarks/sharded.py: a GPT-style decoder with AdamW on synthetic tokens,
run unchanged three ways (the benchmark's docstring).

    --mode hgtrain   under ``hgtrain launch``: ``hg.init()``, ``ctx.wrap`` (the plan says ddp or fsdp,
                     the script does not), ``ctx.shard`` (the plan's batch and micro-batches);
    --mode fsdp      under ``torchrun``: plain FSDP2 (``fully_shard`` on each block, then the root),
                     each rank emulated at its speed and given its batch by benchmarks/ddp_emulation.py's
                     environment (E2E_SPEEDS, E2E_BATCHES, E2E_METRICS), the same Emulator the runtime
                     uses, its step ending where the runtime's fsdp engine ends it (the optimizer's
                     pre-hook, after backward and its reduce-scatters; hgcli/runtime/group/sharded.py).

The model: token and position embeddings, ``--layers`` pre-norm transformer blocks in an
``nn.ModuleList`` (causal self-attention, a 4x GELU MLP), a final norm and an untied LM head. Data:
token sequences of a fixed random Markov chain (``--seed``; each token is followed by its successor
in a fixed permutation with probability 1 - ``--noise``, else by a uniform token), so the loss falls
from ln(vocab) towards the chain's entropy rate. Every run sees the same global batch at each step
(``ctx.shard`` and ``shard_batches`` cut one permutation the same way), so losses compare at equal
samples.

Each step is logged like ``ctx.log`` (``step``: the update, ``samples``, ``loss``). Each rank writes
its own memory to ``--memory-dir/rank<R>.json``: on a CPU the growth of its resident set (the peak
of VmRSS during training, /proc/self/status VmHWM after a reset once the model is wrapped, less VmRSS
before the model was built); on a GPU ``torch.cuda.max_memory_allocated`` over the training steps.

``spec(...)`` is the model in ``hgtrain bench --model``'s contract (the benchmark writes a factory
file with the run's sizes).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """Embeddings, ``layers`` blocks in an ``nn.ModuleList`` (FSDP2's units), norm, LM head."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def markov_tokens(n: int, seq: int, vocab: int, noise: float, seed: int) -> torch.Tensor:
    """``n`` sequences of ``seq + 1`` tokens of the chain (inputs are [:, :-1], targets [:, 1:])."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=gen)
    out = torch.empty(n, seq + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    for t in range(1, seq + 1):
        jump = torch.rand(n, generator=gen) < noise
        out[:, t] = torch.where(jump, torch.randint(0, vocab, (n,), generator=gen), successor[out[:, t - 1]])
    return out


def spec(vocab: int, d_model: int, layers: int, heads: int, seq: int) -> tuple[Any, Any, Any]:
    """The model, a batch maker and the loss, as ``hgtrain bench --model`` takes them."""
    torch.manual_seed(0)
    model = GPT(vocab, d_model, layers, heads, seq)

    def make_batch(batch_size: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        data = markov_tokens(batch_size, seq, vocab, 0.1, batch_size)
        return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)

    return model, make_batch, lm_loss


def entropy_rate(vocab: int, noise: float) -> float:
    """The chain's entropy per token (nats): the least loss a model can reach."""
    stay = 1 - noise + noise / vocab
    other = noise / vocab
    return -(stay * math.log(stay) + (vocab - 1) * other * math.log(other))


# --- memory ------------------------------------------------------------------------------------

def status_kb(field: str) -> int:
    """A figure of /proc/self/status in KiB (VmRSS, VmHWM); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """This rank's peak memory over the training steps (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline_kb = status_kb("VmRSS")       # before the model is built
        self.wrapped_kb = 0
        self.reset = False

    def start_training(self) -> None:
        self.wrapped_kb = status_kb("VmRSS")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.reset = reset_peak_rss()

    def write(self, directory: Path, rank: int, extra: dict[str, Any]) -> None:
        if self.device.type == "cuda":
            peak_mib, kind = torch.cuda.max_memory_allocated(self.device) / 2**20, "cuda_max_allocated"
        else:
            peak_mib, kind = (status_kb("VmHWM") - self.baseline_kb) / 1024, "rss_growth"
        record = {"rank": rank, "kind": kind, "peak_mib": peak_mib, "baseline_rss_mib": self.baseline_kb / 1024,
                  "after_wrap_rss_mib": self.wrapped_kb / 1024, "peak_reset": self.reset, **extra}
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{rank}.json").write_text(json.dumps(record))


# --- the two ways to train -----------------------------------------------------------------------

def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def train(batches: Iterator[tuple[torch.Tensor, ...]], model: nn.Module, opt: torch.optim.Optimizer,
          micro: int, log: Callable[..., None]) -> int:
    """The loop both ways share; ``micro`` pieces make one update. Returns the samples trained."""
    samples = 0
    for piece, (xb, yb) in enumerate(batches):
        loss = lm_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        samples += len(xb)
        log(step=piece // micro, loss=loss.item(), samples=len(xb))
    return samples


def run_hgtrain(args: argparse.Namespace, data: torch.Tensor) -> None:
    import hgcli.runtime as hg

    ctx = hg.init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    probe = MemoryProbe(device)
    model, opt = build(args)
    model, opt = ctx.wrap(model.to(device), opt)
    probe.start_training()
    x, y = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    began = time.time()
    train(iter(ctx.shard((x, y), batch_size=args.batch, epochs=1, seed=0)), model, opt, ctx.micro_batches, ctx.log)
    probe.write(args.memory_dir, ctx.rank, {"micro_batches": ctx.micro_batches, "train_s": time.time() - began})
    ctx.finish()


def run_plain_fsdp(args: argparse.Namespace, data: torch.Tensor) -> None:
    from torch.distributed.fsdp import fully_shard

    from ddp_emulation import EmulatedRank      # benchmarks/ is sys.path[0] when this script runs
    from hgcli.runtime.data.blocks import shard_batches

    torch.set_num_threads(1)     # emulated devices share one CPU, as under the runtime
    er = EmulatedRank()
    probe = MemoryProbe(torch.device("cpu"))
    model, _ = build(args)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def end_compute(*_: Any) -> None:
        er.emulator.end_compute(er.state.step, er.batch)
        er.state.step += 1

    opt.register_step_pre_hook(end_compute)
    opt.register_step_post_hook(lambda *_: er.emulator.begin_compute())
    probe.start_training()
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    er.emulator.begin_compute()
    samples = train(iter(shard_batches((x, y), er.batches, er.rank, epochs=1, seed=0)), model, opt, 1, er.log)
    probe.write(args.memory_dir, er.rank, {"micro_batches": 1})
    er.finish(samples)
    er.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("hgtrain", "fsdp"), default="hgtrain")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="per-rank batch without a plan's")
    p.add_argument("--samples", type=int, default=1920, help="training sequences (one epoch)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-dir", type=Path, required=True)
    args = p.parse_args()
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    data = markov_tokens(args.samples, args.seq, args.vocab, args.noise, args.seed)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    (run_hgtrain if args.mode == "hgtrain" else run_plain_fsdp)(args, data)


if __name__ == "__main__":
    main()

