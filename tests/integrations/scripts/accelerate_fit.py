"""A plain accelerate loop for the integration tests, through ``hgcli.integrations.accelerate.Hgtrain``.
``python accelerate_fit.py OUT``: every rank writes ``OUT/rank<R>.json`` (the sample indices of each of
its batches) and rank 0 the final parameters."""
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hgcli.integrations.accelerate import Hgtrain

from regression import LR, data, net


def main() -> None:
    out = Path(sys.argv[1])
    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    accelerator = Accelerator(cpu=True)
    hg = Hgtrain(accelerator)
    model, opt = accelerator.prepare(model, opt)
    loader = hg.prepare(DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=16, shuffle=True), model)
    seen = []
    for epoch in range(2):
        for xb, yb, index in loader:
            seen.append(index.tolist())
            with hg.step(len(xb)) as step:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                step.loss = loss.item()
            opt.step()
            opt.zero_grad()
    hg.finish()
    record: dict = {"seen": seen}
    if accelerator.process_index == 0:
        record["params"] = [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
