"""A tiny GPT-2 ``transformers.Trainer`` script for the integration tests (built from a config: no
download). ``python hf_fit.py OUT {hgtrain|trainer} [--batch B] [--epochs E]``: trains with
``HgtrainTrainer`` or the plain ``Trainer``; every rank writes ``OUT/rank<R>.json`` (the sample indices of
each of its batches, the optimizer steps) and rank 0 also the final parameters and losses."""
import argparse
import json
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

N, LENGTH, VOCAB = 256, 16, 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (N, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "index": i}


class Collate:
    """Stacks a batch and notes which samples it holds (the Trainer passes the model only tensors)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def __call__(self, features: list[dict]) -> dict:
        self.seen.append([f["index"] for f in features])
        return {k: torch.stack([f[k] for f in features]) for k in ("input_ids", "labels")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("trainer", choices=("hgtrain", "trainer"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if args.trainer == "hgtrain":
        from hgcli.integrations.transformers import HgtrainTrainer as Trainer
    else:
        Trainer = transformers.Trainer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH))
    collate = Collate()
    training = TrainingArguments(output_dir=str(args.out / "trainer"), per_device_train_batch_size=args.batch,
                                 num_train_epochs=args.epochs, learning_rate=1e-3, use_cpu=True, report_to=[],
                                 save_strategy="no", logging_steps=1, remove_unused_columns=False,
                                 dataloader_drop_last=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), data_collator=collate)
    trainer.train()
    rank = training.process_index
    record = {"seen": collate.seen, "optimizer_steps": trainer.state.global_step}
    if rank == 0:
        record["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
        record["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
