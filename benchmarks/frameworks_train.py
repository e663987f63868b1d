"""The training script of benchmarks/frameworks.py, one per framework, each through its hgtrain
integration: ``python frameworks_train.py {lightning|transformers|accelerate} [--batch B] [--epochs E]``.

lightning and accelerate train a regression by an MLP on each of a sample's tokens (hidden --hidden);
transformers a small GPT-2 built from a config (no download). After training, rank 0 prints
``final loss X``: the model's loss over the whole dataset, outside the timed steps."""
from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

SAMPLES, TOKENS_PER_SAMPLE, FEATURES = 3072, 32, 64
TOKENS, LENGTH, VOCAB = 1536, 32, 256


def token_mlp(hidden: int) -> torch.nn.Module:
    """An MLP applied to each of a sample's tokens: a step's compute grows with its batch (the weights
    are used once per token) while the gradient all-reduced stays small, as for a GPU's model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def regression(hidden: int) -> tuple[TensorDataset, torch.nn.Module]:
    """Every token's target is a fixed smooth function of it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, TOKENS_PER_SAMPLE, FEATURES, generator=gen)
    y = torch.tanh(x @ torch.randn(FEATURES, 1, generator=gen) * (2 / FEATURES ** 0.5))
    return TensorDataset(x, y), token_mlp(hidden)


def full_loss(net: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(net(x), y))


def lightning(args: argparse.Namespace) -> None:
    import pytorch_lightning as pl

    from hgcli.integrations.lightning import HgtrainStrategy

    data, net = regression(args.hidden)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

    trainer = pl.Trainer(strategy=HgtrainStrategy(), accelerator="cpu", max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=args.batch, shuffle=True))
    if trainer.global_rank == 0:
        print(f"final loss {full_loss(net, data):.6f}", flush=True)


def accelerate(args: argparse.Namespace) -> None:
    from accelerate import Accelerator

    from hgcli.integrations.accelerate import Hgtrain

    data, net = regression(args.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    accelerator = Accelerator(cpu=True)
    hg = Hgtrain(accelerator)
    model, opt = accelerator.prepare(net, opt)
    loader = hg.prepare(DataLoader(data, batch_size=args.batch, shuffle=True), model)
    for _ in range(args.epochs):
        for x, y in loader:
            with hg.step(len(x)) as step:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                step.loss = loss.item()
            opt.step()
            opt.zero_grad()
    hg.finish()
    if accelerator.process_index == 0:
        print(f"final loss {full_loss(net, data):.6f}", flush=True)


class Tokens(Dataset):
    def __init__(self) -> None:
        # A sequence a language model can learn: each token a fixed function of the previous one.
        gen = torch.Generator().manual_seed(1)
        start = torch.randint(0, VOCAB, (TOKENS, 1), generator=gen)
        steps = torch.arange(LENGTH).unsqueeze(0)
        self.ids = (start * 7 + steps * 13) % VOCAB

    def __len__(self) -> int:
        return TOKENS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def transformers(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from hgcli.integrations.transformers import HgtrainTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=LENGTH))
    training = TrainingArguments(output_dir="hf-out", per_device_train_batch_size=args.batch,
                                 num_train_epochs=args.epochs, learning_rate=1e-3, use_cpu=True,
                                 report_to=[], save_strategy="no", logging_strategy="no",
                                 dataloader_drop_last=True, seed=0, disable_tqdm=True)
    data = Tokens()
    trainer = HgtrainTrainer(model=model, args=training, train_dataset=data)
    trainer.train()
    if training.process_index == 0:
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=data.ids, labels=data.ids).loss
        print(f"final loss {float(loss):.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("lightning", "transformers", "accelerate"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's (lightning, accelerate)")
    args = parser.parse_args()
    {"lightning": lightning, "transformers": transformers, "accelerate": accelerate}[args.framework](args)


if __name__ == "__main__":
    main()
