"""Per-rank batches: each step's global batch is one block of a seeded permutation, cut by the plan's
(or the rebalancer's) sizes; ``ctx.shard``'s stream and ``ctx.sampler``/``ctx.loader``'s sampler."""
