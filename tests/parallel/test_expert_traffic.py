"""Tensor-parallel experts reduce once per token, not once per routed slot: the all-reduce bytes of one forward
and backward of a mixture block over 2 real gloo ranks (counted by llmtrain/bench/comm_count.py), against T x d
each way plus one number per routed slot (its routing weight's gradient); and the router's and the input's
gradients those of the unsplit block. Lean like test_comm_count.py: the spawned ranks import this module, not
conftest."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from llmtrain.bench.comm_count import CommCounter

RANKS, TOKENS = 2, 24


def _worker(rank: int, store_path: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from llmtrain.model import build_model
    from llmtrain.model.moe import MoE
    from llmtrain.parallel.tp import SplitExperts
    from llmtrain.tools import compose_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, RANKS), rank=rank, world_size=RANKS)

    def mixture() -> MoE:
        model = build_model(compose_config(["model=moe-tiny"]).model, 97, seed=0)
        return next(block.mlp for block in model.blocks.values() if isinstance(block.mlp, MoE)).eval()

    whole, moe = mixture(), mixture()
    parallelize_module(moe, init_device_mesh("cpu", (RANKS,)), {"experts": SplitExperts()})
    x = torch.randn(1, TOKENS, moe.router.in_features, generator=torch.Generator().manual_seed(0))
    x_split, x_whole = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole(x_whole).square().sum().backward()
    with CommCounter() as counter:
        moe(x_split).square().sum().backward()
    torch.testing.assert_close(x_split.grad, x_whole.grad)
    torch.testing.assert_close(moe.router.weight.grad, whole.router.weight.grad)
    results.put((rank, counter.bytes, moe.moe.top_k, moe.router.in_features))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks import torch: ~10 s
def test_tensor_parallel_experts_all_reduce_tokens_not_routed_slots(tmp_path):
    results = mp.get_context("spawn").Queue()
    from harness.processes import rank_slots  # here: the spawned ranks import this module, and only what it needs

    with rank_slots(RANKS):
        mp.start_processes(_worker, args=(str(tmp_path / "store"), results), nprocs=RANKS, start_method="spawn")
    for _ in range(RANKS):
        _, moved, top_k, d_model = results.get(timeout=120)
        per_token = TOKENS * d_model * 4  # fp32: the output's partial sums forward, the input's gradient backward
        routing_weights = TOKENS * top_k * 4  # backward: each slot's weight gradient, one number
        expected = 2 * per_token + routing_weights
        assert moved == {"all_reduce": expected}, (moved, f"per routed slot it would be {2 * top_k * per_token}")
