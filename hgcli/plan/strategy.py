"""Strategies: speed classes, group layouts, and the choice among allreduce, hybrid and ps (the rules
of docs/planning.md)."""
from __future__ import annotations

from collections.abc import Mapping

from ..schema.stages import Prediction, Strategy
from .costed import Device, Option

# Devices whose throughputs differ by at most this factor are "like" and may share an all-reduce group.
LIKE_SPEED_RATIO = 1.25
# auto keeps synchronous all-reduce unless another strategy is predicted more than this much faster.
AUTO_MARGIN = 0.05


def speed_classes(devices: list[Device], batches: list[float]) -> list[list[int]]:
    """Devices sorted by samples/s at their batch; a class holds devices within LIKE_SPEED_RATIO of
    its fastest member, so a class never spans more than that ratio. The batches are the real-valued
    ones, so rounding never splits identical devices."""
    speed = [b / d.time(b) for d, b in zip(devices, batches)]
    order = sorted(range(len(devices)), key=lambda i: -speed[i])
    classes: list[list[int]] = []
    for i in order:
        if classes and speed[classes[-1][0]] <= LIKE_SPEED_RATIO * speed[i]:
            classes[-1].append(i)
        else:
            classes.append([i])
    return [sorted(c) for c in classes]


def hybrid_layouts(devices: list[Device], classes: list[list[int]]) -> list[tuple[tuple[int, ...], ...]]:
    """Two groupings of the speed classes: one group per class (spanning nodes), and one group per
    class and node (all-reduce only on intra-node links). The cost model picks between them."""
    merged = tuple(tuple(c) for c in classes)
    per_node: list[tuple[int, ...]] = []
    for c in classes:
        by_node: dict[int, list[int]] = {}
        for i in c:
            by_node.setdefault(devices[i].node, []).append(i)
        per_node.extend(tuple(v) for v in by_node.values())
    layouts = [merged]
    if len(per_node) != len(merged):
        layouts.append(tuple(per_node))
    return layouts


def predicted_best(predicted: Mapping[Prediction, float]) -> Strategy:
    """The strategy ``auto`` takes from the cost model's predictions (``predicted``: samples/s by
    strategy name): hybrid when it beats allreduce by more than AUTO_MARGIN, else allreduce. ps is
    never auto's pick: it splits every speed class into one asynchronous group per device, and each
    group more adds staleness and, under Adam and kin, a full optimizer step per push, which cost
    accuracy that samples/s does not show (docs/planning.md, rule 2). ``auto`` follows this except on
    a homogeneous cluster (rule 1)."""
    ar, hy = predicted[Strategy.ALLREDUCE], predicted[Strategy.HYBRID]
    return Strategy.HYBRID if hy > ar * (1 + AUTO_MARGIN) else Strategy.ALLREDUCE


def _ps_aside(ps: Option, chosen: Option) -> str:
    """What the reason adds when the predictions favour ps over auto's pick (rule 2)."""
    if (ps.samples_per_s <= chosen.samples_per_s * (1 + AUTO_MARGIN)
            or sorted(ps.groups) == sorted(chosen.groups)):
        return ""
    return (f"; ps (every device its own asynchronous group) was predicted "
            f"{ps.samples_per_s / chosen.samples_per_s - 1:.0%} above it, but auto keeps like-speed devices "
            f"synchronous: --strategy ps asks for it")


def choose(requested: Strategy, options: dict[Strategy, Option], classes: int,
            devices: int) -> tuple[Option, str]:
    ar = options[Strategy.ALLREDUCE]
    if requested is not Strategy.AUTO:
        chosen = options[requested]
        auto, _ = choose(Strategy.AUTO, options, classes, devices)
        note = "" if auto is chosen else f"; auto would choose {auto.strategy.value}"
        return chosen, f"{requested.value} requested ({chosen.summary}){note}"
    hy, ps = options[Strategy.HYBRID], options[Strategy.PS]
    if classes == 1:
        # Rule 1 holds whatever the predictions say; saying what they favour lets a user ask for it.
        best = max((hy, ps), key=lambda o: o.samples_per_s)
        aside = "" if best.samples_per_s <= ar.samples_per_s * (1 + AUTO_MARGIN) else (
            f"; the predictions alone favour {best.strategy.value} "
            f"({best.samples_per_s / ar.samples_per_s - 1:.0%} above allreduce; "
            f"--strategy {best.strategy.value} asks for it)")
        return ar, (f"homogeneous: all {devices} devices within {LIKE_SPEED_RATIO}x of each other's speed, "
                    f"so one synchronous all-reduce group (plain DDP) with no parameter servers{aside}")
    best = options[predicted_best({s: o.samples_per_s for s, o in options.items()})]
    if best is ar:
        return ar, (f"allreduce predicted {ar.samples_per_s:.4g} samples/s, hybrid {hy.samples_per_s:.4g}: "
                    f"not more than {AUTO_MARGIN:.0%} faster, so the synchronous all-reduce is kept "
                    f"({classes} speed classes, batches proportional to speed){_ps_aside(ps, ar)}")
    gain = best.samples_per_s / ar.samples_per_s - 1
    return best, (f"{best.strategy.value} predicted {best.samples_per_s:.4g} samples/s, {gain:.0%} above "
                  f"allreduce ({ar.samples_per_s:.4g}): {classes} speed classes, {best.summary}"
                  f"{_ps_aside(ps, best)}")


def unported_choice(options: dict[Strategy, Option], auto: Option, why: str) -> tuple[Option, str]:
    """``auto`` for a script that does not call ``hg.init()`` (plan/script_use.py, ``why`` says how
    that is known): allreduce, the only plan such a script trains under, saying what auto would have
    chosen had it been ported (rule 0)."""
    ar = options[Strategy.ALLREDUCE]
    return ar, (f"allreduce ({ar.summary}), not {auto.strategy.value}: {why}, and only a script that calls "
                f"hg.init() trains under parameter servers (port it, docs/runtime.md, and auto would "
                f"choose {auto.strategy.value})")
