"""Training with the optimizer side of real scripts: AdamW with two parameter groups, an LR schedule,
clipping by the runtime (--max-grad-norm), autocast (--amp bf16|fp16, fp16 with a GradScaler),
BatchNorm (--model bn). Driven by tests/runtime/test_optim.py through hgcli.local.

Writes <out>/rank<R>.pt: {"state": model.state_dict() after ctx.finish(), "version", "scale" (the
GradScaler's final scale or None), "lrs" (group learning rates at each step), "grad_norms"}; with
--state-step K, rank 0 also writes <out>/state.pt after step K: {"state": ctx.state_dict() while its
local model was deliberately corrupted, "local": the local model's state before, "version"}.
"""
import torch
import torch.nn.functional as F

import hgcli.runtime as hg
from common import parser
from hgcli.examples.data import make_dataset
from optim_setup import adamw, make_model, warmup_cosine


class MainAdamW(torch.optim.AdamW):
    """Defined in the script (__main__): the PS ranks cannot import it."""


def make_optimizer(kind: str, model: torch.nn.Module, args) -> torch.optim.Optimizer:
    if kind == "adamw":
        return adamw(model, args.lr)
    if kind == "main":
        return MainAdamW(model.parameters(), lr=args.lr)
    if kind == "user":
        from user_optim import PlainSGD
        return PlainSGD(model.parameters(), lr=args.lr)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)


def main():
    p = parser()
    p.add_argument("--model", choices=["ln", "bn"], default="ln")
    p.add_argument("--opt", choices=["adamw", "sgd", "main", "user"], default="adamw")
    p.add_argument("--schedule", action="store_true")
    p.add_argument("--max-grad-norm", type=float, default=0.0)
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    p.add_argument("--inf-rank", type=int, default=-1, help="this rank's gradient gets an inf ...")
    p.add_argument("--inf-step", type=int, default=-1, help="... at this step")
    p.add_argument("--shift-group", type=int, default=-1, help="this group's inputs are shifted ...")
    p.add_argument("--shift", type=float, default=0.0, help="... by this much")
    p.add_argument("--state-step", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = hg.init()
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    if ctx.group == args.shift_group:
        x = x + args.shift
    net = make_model(args.model, args.hidden)        # its own names: the DDP module's are "module."-prefixed
    opt = make_optimizer(args.opt, net, args)
    sched = warmup_cosine(opt, args.steps) if args.schedule else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000) if args.amp == "fp16" else None
    model, opt = ctx.wrap(net, opt, max_grad_norm=args.max_grad_norm or None)
    lrs, norms = [], []
    for step, (xb, yb) in enumerate(ctx.shard((x, y), batch_size=args.batch, epochs=1000)):
        if step == args.steps:
            break
        lrs.append([g["lr"] for g in opt.param_groups])
        with torch.autocast("cpu", dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16,
                            enabled=args.amp != "none"):
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        if scaler is not None:
            if ctx.rank == args.inf_rank and step == args.inf_step:
                loss = loss * float("inf")          # an fp16 overflow in this rank's backward, say
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()
        norms.append(ctx.grad_norm)
        if ctx.rank == 0 and step == args.state_step:
            save_state_with_local_corrupted(ctx, net, args)
    ctx.finish()
    torch.save({"state": net.state_dict(), "version": ctx.version, "lrs": lrs, "grad_norms": norms,
                "scale": scaler.get_scale() if scaler is not None else None}, args.out / f"rank{ctx.rank}.pt")
    print(f"done version {ctx.version}", flush=True)


def save_state_with_local_corrupted(ctx, model, args):
    """ctx.state_dict() must come from the PS: the local parameters and buffers are garbage meanwhile."""
    local = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.add_(1000.0)
        state = ctx.state_dict()
        model.load_state_dict(local)
    torch.save({"state": state, "local": local, "version": ctx.version}, args.out / "state.pt")


if __name__ == "__main__":
    main()
