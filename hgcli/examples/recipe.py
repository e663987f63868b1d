"""What the bundled example and its plain DDP twin share: arguments, data, optimizer, schedule,
mixed precision, evaluation and progress lines. ``train.py`` (hgcli.runtime) and ``ddp_resnet.py``
(torchrun, DDP) differ only in the lines that distribute the training (docs/runtime.md, "Porting a
DDP script"), so everything else lives here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from .shapes import Shapes

TARGET = 0.95           # the accuracy the default run states (docs/runtime.md, "The bundled example")
QUICK_TARGET = 0.70     # ... and the one --quick states (tests)
EVAL_BATCH = 256


def parse_args(doc: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch unless the plan sets one")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW's peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.05, help="on weights; none on norms and biases")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the steps the LR warms up over")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient 2-norm clipped to this")
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--test-size", type=int, default=2048)
    parser.add_argument("--eval-samples", type=int, default=512,
                        help="test images of the evaluation after each epoch (the final one uses all)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), default="auto",
                        help="autocast dtype; auto: bf16 where the device has it natively, else off")
    parser.add_argument("--blocks", type=int, default=1, help="basic blocks per ResNet stage (3: ResNet-20)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (ranks of the emulated cluster share the CPU)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the model's initial parameters and the training data's order (every rank the same)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--target", type=float, default=None, help=f"accuracy to state (default {TARGET})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small run for tests: 2048 training images, 512 test images, 3 epochs, "
                             f"batch 32, target {QUICK_TARGET}")
    args = parser.parse_args(argv)
    if args.quick:
        args.train_size, args.test_size, args.epochs, args.batch = 2048, 512, 3, 32
    if args.target is None:
        args.target = QUICK_TARGET if args.quick else TARGET
    return args


def datasets(args: argparse.Namespace) -> tuple[Shapes, Shapes]:
    """Training and test sets: two seeds of the same generator (docs/runtime.md)."""
    return Shapes(args.train_size, seed=0), Shapes(args.test_size, seed=1)


def loader_options(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """DataLoader arguments besides the batches: worker processes that draw the images (the rank's
    own thread only trains), kept across epochs, and pinned memory for a GPU."""
    return {"num_workers": args.workers, "persistent_workers": args.workers > 0,
            "pin_memory": device.type == "cuda"}


def amp_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, None for full precision. ``auto`` takes bf16 where it is native: a CUDA
    device that supports it, a CPU with AVX512-BF16/AMX (oneDNN's check); elsewhere CPU autocast
    emulates bf16 and runs slower than float32."""
    if choice == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
        return torch.bfloat16 if _cpu_has_native_bf16() else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[choice]


def _cpu_has_native_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:        # a build without oneDNN
        return False


def autocast(device: torch.device, dtype: torch.dtype | None) -> ContextManager[Any]:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with two parameter groups: weight decay on the convolution and linear weights, none on
    BatchNorm's scales and shifts and on biases (decaying them only fights the normalisation)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr)


def make_scheduler(opt: torch.optim.Optimizer, args: argparse.Namespace,
                   steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``args.warmup`` of the steps, then cosine decay to 1% of the peak, over the
    steps this run makes (``--max-steps`` shortens it: a short run still anneals)."""
    total = args.epochs * steps_per_epoch
    if args.max_steps > 0:
        total = min(total, args.max_steps)
    warm = max(1, round(args.warmup * total))
    return torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.05, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total - warm), eta_min=args.lr / 100),
    ], milestones=[warm])


def torchrun_device() -> torch.device:
    """A torchrun rank's device: the GPU of its LOCAL_RANK, else the CPU. Modulo the GPUs it sees:
    under ``hgtrain launch`` a rank sees only its own GPU (CUDA_VISIBLE_DEVICES), as cuda:0."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)       # NCCL's communicator uses the current device
    return device


class Report:
    """Progress of one rank: every step's loss, an evaluation after each epoch and the final one.

    With ``log`` (hgcli's ``ctx.log``: the launcher's live table and summary read its fields) every
    rank logs every step (its loss every ``LOSS_EVERY``), and the main rank its evaluations; without it the main rank prints a line
    now and then. Evaluations run on the main rank only, inside ``untimed`` (hgcli's
    ``ctx.untimed``: device emulation must not stretch them)."""

    PRINT_EVERY = 50
    LOSS_EVERY = 10

    def __init__(self, args: argparse.Namespace, device: torch.device, amp: torch.dtype | None, *,
                 main: bool, log: Callable[..., None] | None = None,
                 untimed: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.args, self.device, self.amp, self.main = args, device, amp, main
        self._log, self._untimed = log, untimed
        self._start: float | None = None
        self._test: tuple[torch.Tensor, torch.Tensor] | None = None
        self.samples = 0
        self.reached: float | None = None

    @property
    def elapsed(self) -> float:
        return time.time() - self._start if self._start is not None else 0.0

    def step(self, step: int, loss: torch.Tensor, samples: int) -> None:
        if self._start is None:
            self._start = time.time()     # training time counts from the first batch
        self.samples += samples
        if self._log is not None:
            # Samples every step (the throughput); the loss every LOSS_EVERY steps: reading it is a
            # host sync on a GPU, which would stall the next step's kernels every step.
            if step % self.LOSS_EVERY == 0:
                self._log(step=step, loss=loss.item(), samples=samples)
            else:
                self._log(step=step, samples=samples)
        elif self.main and step % self.PRINT_EVERY == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    def evaluate(self, model: nn.Module, test_set: Shapes, step: int, epoch: int) -> None:
        if not self.main:
            return
        with self._untimed():
            acc = self.accuracy(model, test_set, self.args.eval_samples)
        if self.reached is None and acc >= self.args.target:
            self.reached = self.elapsed
        self._emit(f"epoch {epoch} (step {step}): test accuracy {acc:.4f} on {self.args.eval_samples} images "
                   f"after {self.elapsed:.1f} s", event="eval", step=step, epoch=epoch, accuracy=acc,
                   elapsed_s=self.elapsed)

    def final(self, model: nn.Module, test_set: Shapes) -> float | None:
        """The final accuracy on the whole test set (main rank; None elsewhere), logged and printed."""
        if not self.main:
            return None
        acc = self.accuracy(model, test_set, len(test_set))
        target = self.args.target
        self._emit(None, event="final", accuracy=acc, elapsed_s=self.elapsed, target=target,
                   time_to_target_s=self.reached)
        verdict = "reached" if acc >= target else "NOT reached"
        print(f"final test accuracy {acc:.4f} after {self.elapsed:.1f} s (target {target}: {verdict}); "
              f"this rank trained on {self.samples} samples", flush=True)
        return acc

    def accuracy(self, model: nn.Module, test_set: Shapes, n: int) -> float:
        # DDP's forward on one rank alone could start a buffer broadcast the other ranks never join:
        # evaluate the module inside it.
        net: nn.Module = getattr(model, "module", model)
        if self._test is None:
            images, labels = zip(*(test_set[i] for i in range(len(test_set))))
            self._test = (torch.stack(images).to(self.device), torch.tensor(labels, device=self.device))
        x, y = self._test[0][:n], self._test[1][:n]
        was = net.training
        net.eval()
        correct = 0
        with torch.no_grad(), autocast(self.device, self.amp):
            for i in range(0, len(x), EVAL_BATCH):
                correct += int((net(x[i:i + EVAL_BATCH]).argmax(dim=1) == y[i:i + EVAL_BATCH]).sum())
        net.train(was)
        return correct / len(x)

    def _emit(self, line: str | None, **fields: Any) -> None:
        if self._log is not None:
            self._log(**fields)
        if line is not None:
            print(line, flush=True)
