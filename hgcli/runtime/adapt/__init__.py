"""Run-time adaptation above the engine: members' batches that follow their measured speed
(rebalance), the groups' shares of the global batch (shares, decided by PS shard 0), and the compute
clock that measures them."""
