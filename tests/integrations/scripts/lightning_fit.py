"""A small Lightning script for the integration tests: an MLP regression on fixed synthetic data.

``python lightning_fit.py OUT {hgtrain|ddp} [--batch B] [--epochs E] [--steps S] [--accumulate K] [--devices auto]``:
trains with
``HgtrainStrategy()`` or Lightning's own ``DDPStrategy``; every rank writes ``OUT/rank<R>.json``
(the sample indices of each of its batches, its losses, the optimizer steps, the strategy's class)
and rank 0 also the final parameters (gathered from their shards under FSDP2)."""
import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from regression import LR, data, net


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(index.tolist())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter: an FSDP2 shard (a DTensor) all-gathered, a plain tensor as it is."""
    gather = getattr(param, "full_tensor", None)
    return (gather() if gather is not None else param).detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("strategy", choices=("hgtrain", "ddp"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=-1, help="Trainer(max_steps=...)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--devices", default=os.environ.get("LOCAL_WORLD_SIZE", "1"),
                        help="Trainer(devices=...): the node's ranks (as torchrun users set it), or auto")
    args = parser.parse_args()
    x, y = data()
    loader = DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=args.batch, shuffle=True)
    if args.strategy == "hgtrain":
        from hgcli.integrations.lightning import HgtrainStrategy

        strategy = HgtrainStrategy()
    else:
        strategy = pl.strategies.DDPStrategy()
    model = Regression()
    devices = args.devices if args.devices == "auto" else int(args.devices)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                         max_epochs=args.epochs, max_steps=args.steps, accumulate_grad_batches=args.accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    record = {"seen": model.seen, "losses": model.losses, "optimizer_steps": trainer.global_step,
              "strategy": type(trainer.strategy).__name__}
    params = [full(p).flatten().tolist() for p in model.parameters()]     # every rank: a collective
    if rank == 0:
        record["params"] = params
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
