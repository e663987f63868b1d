"""The cost model of the planner: predicted samples/s of a layout of groups and PS ranks.

Pure, like the planner that calls it. ``CostModel`` is one class of the predictor of each strategy
and the pieces they share: the common ground and the all-reduce prediction (``pricing``), the PS
placement and exchange costs (``ps``), over the network (``network``) and the delays (``delays``) of
the values in ``costed``; this module predicts the layouts with parameter servers. Every formula and
constant is documented in docs/planning.md (change both together). Work is per group, per node or per
PS node, never over all device pairs.
"""
from __future__ import annotations

import math

from ..schema.stages import Strategy
from .costed import GroupStats, Option
from .delays import compute_cpu, straggle
from .ps import ExchangeCosts, PSPlacement
from .pricing import AllReducePredictor

# Accumulation is capped so a slow group still pushes now and then.
MAX_ACCUMULATE = 64
# A batch (a device's) or a push (a hybrid group's batch x accumulation) is sized at its "knee": the
# smallest size whose samples/s is within this fraction of the best that size can reach.
KNEE_TOLERANCE = 0.05
# A push weighs samples / global batch on the PS (docs/runtime-reference.md): a push of k global batches is one
# step k times as large. Measured end to end (benchmarks/pipeline_e2e.py, benchmarks/RESULTS.md),
# pushes of several global batches cost the hybrid runs far more accuracy against DDP than pushes of
# one, so a push stays one global batch until the PS's update rule accounts for size.
MAX_PUSH_GLOBAL_BATCHES = 1
# Staleness bound = slack x the pushes other groups make during the slowest group's window.
STALENESS_SLACK = 2.0


class _AsyncPredictor(AllReducePredictor, PSPlacement, ExchangeCosts):
    """Groups with parameter servers (Strategy.HYBRID, Strategy.PS): the layout, accumulation and
    PS placement that predict the most samples/s."""

    def best_async(self, strategy: Strategy, layouts: list[tuple[tuple[int, ...], ...]]) -> Option:
        """The fastest layout and PS count; a candidate must win by 1% to displace an earlier one,
        so ties keep the fewer groups and the fewer PS ranks."""
        candidates: list[Option] = []
        if self.fixed_ps and any(len(g) > 1 for g in layouts):
            layouts = [g for g in layouts if len(g) > 1]   # one group would have no PS to keep
        for groups in layouts:
            if len(groups) == 1:
                one = self.allreduce()
                candidates.append(Option(strategy, one.groups, one.accumulate, (), 0, one.samples_per_s,
                                          "a single group: no parameter servers", one.group_rates))
            else:
                candidates.extend(self._with_ps(strategy, groups))
        best = candidates[0]
        for option in candidates[1:]:
            if option.samples_per_s > best.samples_per_s * 1.01:
                best = option
        return best

    def _with_ps(self, strategy: Strategy, groups: tuple[tuple[int, ...], ...]) -> list[Option]:
        stats = [self._group(g) for g in groups]
        placements = self.ps_placements(sorted({s.leader for s in stats}))
        return [self._predict_async(strategy, groups, stats, nodes, len(placements)) for nodes in placements]

    def _push_knee(self, stats: GroupStats, overhead: float) -> int:
        """A hybrid group's accumulation: the smallest push (batch x accumulation) whose samples/s,
        acc * B / (acc * T + overhead), is within KNEE_TOLERANCE of the group's compute-bound
        B / T, i.e. acc >= (1 - tol) / tol * overhead / T; at most the first accumulation that
        reaches MAX_PUSH_GLOBAL_BATCHES global batches (a group whose step is just short of a global
        batch may still double its push when the exchange is dear), and MAX_ACCUMULATE steps.
        No floor: every push is one update of the PS's optimizer, and with AdamW (or momentum) the
        number of updates, not their size, sets the progress per sample; a group that accumulated to
        a whole global batch gave the PS about two thirds of the updates DDP makes over the same
        samples (docs/planning.md, "Push size")."""
        knee = 1
        if overhead > 0 and stats.compute > 0:
            knee = math.ceil((1 - KNEE_TOLERANCE) / KNEE_TOLERANCE * overhead / stats.compute - 1e-9)
        most = max(1, math.ceil(MAX_PUSH_GLOBAL_BATCHES * self.global_batch / stats.samples - 1e-9))
        return min(MAX_ACCUMULATE, max(1, min(knee, most)))

    def _predict_async(self, strategy: Strategy, groups: tuple[tuple[int, ...], ...],
                       stats: list[GroupStats], ps_nodes: tuple[int, ...], tried: int = 1) -> Option:
        count = len(ps_nodes)
        node_share: dict[int, float] = {}
        ps_ranks: dict[int, int] = {}
        for q in ps_nodes:
            node_share[q] = node_share.get(q, 0.0) + self.wire / count
            ps_ranks[q] = ps_ranks.get(q, 0) + 1
        # Latencies under oversubscribed cores (oversubscription): a group's ring on its nodes, an
        # RPC round trip on the leader's node and the PS nodes'.
        ps_wait = max(self._oversub(q, ps_ranks) for q in ps_ranks)
        exchange = {n: self._push_pull_s(n, node_share, count, max(ps_wait, self._oversub(n, ps_ranks)))
                    for n in {s.leader for s in stats}}
        syncs = [s.sync + s.latency * (max(self._oversub(n, ps_ranks) for n in s.nodes) - 1.0) for s in stats]
        overheads = [sync + exchange[s.leader] for s, sync in zip(stats, syncs)]
        if strategy is Strategy.HYBRID:
            # asynchronous large mini-batch, sized for throughput (the push's knee)
            accumulate = tuple(self._push_knee(s, o) for s, o in zip(stats, overheads))
        else:
            accumulate = (1,) * len(stats)   # the classic asynchronous PS: every worker pushes every step
        windows = self._windows(groups, stats, accumulate, syncs, exchange, node_share, count)
        if self.job.staleness is not None:
            # A bound S lets a group push at most S - groups + 2 times per push of the slowest before
            # it waits (docs/runtime-reference.md). A hybrid group that would get further ahead pushes larger
            # instead (fewer pushes, same samples); what is still ahead at the cap waits.
            # With overlap every group has one more gradient in flight: groups more of the bound.
            ahead = max(1, max(self.job.staleness, len(groups) - 1) - len(groups) + 2
                        - (len(groups) if self.overlap else 0))
            slowest = max(windows)
            if strategy is Strategy.HYBRID and any(slowest / w > ahead for w in windows):
                accumulate = tuple(
                    acc if slowest / w <= ahead else
                    max(acc, min(MAX_ACCUMULATE, math.ceil((slowest / ahead - o) / (s.compute or 1e-12))))
                    for acc, w, o, s in zip(accumulate, windows, overheads, stats))
                windows = self._windows(groups, stats, accumulate, syncs, exchange, node_share, count)
                slowest = max(windows)
            windows = [max(w, slowest / ahead) for w in windows]
        # Every worker runs the same number of steps per epoch (ctx.sampler: each step's batches are
        # one block of the epoch's permutation), so a group whose steps are shorter finishes its share
        # first and waits in ctx.finish() while the others run: over the run, every group's samples
        # per step over the slowest group's time per step. Its own rate while running is what the
        # launch summary measures per group.
        step_s = [w / acc for w, acc in zip(windows, accumulate)]
        group_rates = tuple(s.samples / t for s, t in zip(stats, step_s))
        rate = sum(s.samples for s in stats) / max(step_s)
        total_pushes = sum(1.0 / w for w in windows)
        slowest = 1.0 / max(windows)
        staleness = self.job.staleness
        if staleness is None:
            staleness = max(1, math.ceil(STALENESS_SLACK * (total_pushes - slowest) / slowest))
            if self.overlap:         # each group's own push in flight, and one more round of the others'
                staleness += len(groups)
        # The runtime's waiting rule (docs/runtime-reference.md) needs S >= groups - 1 (S >= groups with overlap):
        # with a smaller bound every group could be waiting for another. A lower --staleness is raised.
        staleness = max(staleness, len(groups) if self.overlap else len(groups) - 1)
        return Option(strategy, groups, accumulate, ps_nodes, staleness, rate,
                      f"{len(groups)} groups, {self._where(ps_nodes, stats, tried)}", group_rates)

    def _windows(self, groups: tuple[tuple[int, ...], ...], stats: list[GroupStats], accumulate: tuple[int, ...],
                 syncs: list[float], exchange: dict[int, float], node_share: dict[int, float],
                 count: int) -> list[float]:
        """Seconds between two pushes of each group: its accumulated compute, all-reduce and PS
        exchange, stretched by a shared NIC, a saturated PS and crowded CPUs."""
        # With overlap the exchange runs during the next step: a window is the longer of the two,
        # except the leader's own CPU work of the exchange, which stays on its training thread.
        if self.overlap:
            windows = [max(acc * s.compute * straggle(s.noise, len(g), acc) + self._client_cpu_s(s.leader),
                           exchange[s.leader]) + sync for s, sync, acc, g in zip(stats, syncs, accumulate, groups)]
        else:
            windows = [acc * s.compute * straggle(s.noise, len(g), acc) + exchange[s.leader] + sync
                       for s, sync, acc, g in zip(stats, syncs, accumulate, groups)]
        # A node's NIC carries the pushes and pulls of every group led from it: share it.
        nic_load: dict[int, float] = {}
        for s, window in zip(stats, windows):
            remote = self.wire - node_share.get(s.leader, 0.0)
            nic_load[s.leader] = nic_load.get(s.leader, 0.0) + 2 * remote / self.net.nic[s.leader] / window
        windows = [w * max(1.0, nic_load[s.leader]) for s, w in zip(stats, windows)]
        pushes_from: dict[int, float] = {}
        for s, window in zip(stats, windows):
            pushes_from[s.leader] = pushes_from.get(s.leader, 0.0) + 1.0 / window
        total_pushes = sum(1.0 / w for w in windows)
        loads = {q: self._ps_load(q, share, total_pushes, pushes_from.get(q, 0.0), count)
                 for q, share in node_share.items()}
        scale = max(1.0, max(loads.values()))     # a saturated PS slows every group down alike
        windows = [w * scale for w in windows]
        # Emulated devices and PS ranks sharing a node's cores (node CPU seconds per second).
        busy = {q: load / scale for q, load in loads.items()}
        # CPU work of communication: its uncontended time (waiting for a core is not demand).
        own = {n: self._push_pull_s(n, node_share, count, 1.0) for n in exchange}
        for g, s, acc, w in zip(groups, stats, accumulate, windows):
            for i in g:
                d = self.devices[i]
                if d.emulated:
                    cpu = acc * compute_cpu(d, self.batches[i]) + s.sync + own[s.leader]
                    busy[d.node] = busy.get(d.node, 0.0) + cpu / w
        crowded = self._crowding(busy)
        if crowded:
            windows = [w * max((crowded.get(self.devices[i].node, 1.0) for i in g), default=1.0)
                       for g, w in zip(groups, windows)]
        return windows


class CostModel(_AsyncPredictor):
    """Predicts samples/s of a layout; see docs/planning.md for every formula. One class of the
    predictor of each strategy and the pieces they share, each in its module (above)."""
