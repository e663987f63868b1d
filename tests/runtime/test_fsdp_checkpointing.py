"""Activation checkpointing in fsdp groups (group/fsdp.py, launch --activation-checkpointing): each
block's activations recomputed in backward, the gradients those of plain FSDP2 without it."""
import json

import pytest
import torch

from hgcli.runtime.errors import TrainingError
from hgcli.runtime.group.fsdp import checkpoint_units, shard_units

from .helpers import run_ok, script
from .test_fsdp import _fsdp_plan


@pytest.mark.slow
def test_gradients_with_activation_checkpointing_are_those_without(tmp_path):
    run_ok(_fsdp_plan([8, 8]), script("fsdp_checkpointing.py", "--out", tmp_path), tmp_path, timeout_s=120,
           extra_env={"HGTRAIN_ACTIVATION_CHECKPOINT": "1"})
    for r in range(2):
        result = json.loads((tmp_path / f"result{r}.json").read_text())
        assert result["max_diff"] == 0.0, result
        # Once in forward, once recomputed in backward: the checkpointing is on (without it: once).
        assert result["block_forwards"] == 2 * result["steps"], result


def test_nested_units_are_checkpointed_at_the_outermost_only_and_none_is_refused():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))

    model = Flat()
    checkpoint_units(model, shard_units(model, "a*"))
    from torch.distributed._composable.contract import _get_registry

    assert "checkpoint" in (_get_registry(model.a) or {})
    assert not _get_registry(model.a[0])
    with pytest.raises(TrainingError, match="has no unit below the root to checkpoint") as err:
        checkpoint_units(Flat(), [])
    assert "\n" not in str(err.value)
