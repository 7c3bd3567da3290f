"""Expert parallelism (llmtrain/parallel/expert.py): the all-to-all exchange against one process holding every
expert (forward and gradients, real gloo processes, including ranks whose experts receive no token), and its
one-line errors. The layouts with parallel.ep > 1 against the unsplit model: tests/model/test_moe.py."""

from __future__ import annotations

import json

import pytest
from harness.paths import WORKERS
from harness.processes import torchrun

from llmtrain.differences import largest, within
from llmtrain.errors import ConfigError
from llmtrain.parallel_plan import check_expert_parallel, resolve_degrees
from llmtrain.tools import compose_config


@pytest.mark.slow  # four processes' imports: ~15 s on two cores
def test_all_to_all_experts_equal_one_process_holding_them_all(tmp_path):
    """Outputs, input gradients and expert weight gradients at ep 4 and 2, with tokens spread over the experts
    and with every token sent to experts 0 and 1 (the other ranks get nothing and must still join every
    exchange, forward and backward, or the group hangs)."""
    torchrun(4, str(WORKERS / "expert_worker.py"), str(tmp_path), timeout=120)
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert all(len(cases) == 4 for cases in found)
    assert within(largest(error for cases in found for error in cases.values()), 1e-12), found


@pytest.mark.parametrize(
    "args, key",
    [
        ((2, 0, True, "fsdp"), "model.moe.num_experts=0"),
        ((3, 8, True, "fsdp"), "model.moe.num_experts=8"),
        ((2, 8, False, "ddp"), "parallel=ddp"),
        ((2, 8, True, "fsdp", "selective"), "train.activation_checkpointing=selective"),
    ],
)
def test_expert_parallel_errors_name_the_key(args, key):
    with pytest.raises(ConfigError) as error:
        check_expert_parallel(*args)
    assert key in str(error.value) and "\n" not in str(error.value)


def test_ep_must_divide_the_sharded_ranks():
    parallel = compose_config(["parallel=fsdp", "parallel.dp_shard=4", "parallel.ep=3"]).parallel
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide dp_shard x cp = 4"):
        resolve_degrees(parallel, 4)
    degrees = resolve_degrees(compose_config(["parallel=fsdp", "parallel.ep=2"]).parallel, 8)
    assert (degrees.dp_shard, degrees.ep, degrees.expert_shard) == (8, 2, 4)
