"""The collective byte counter (llmtrain/bench/comm_count.py): 4 real gloo ranks issue collectives of known size,
directly, through DDP's C++ reducer and through FSDP2, and each rank's counts must be exactly the definitions'.

The ranks meet through a FileStore rather than conftest's port and environment: every spawned rank re-imports this
module, and leaving conftest (Hydra, the whole package: ~2 s of CPU a rank) out of it keeps the test near 20 s on
two idle cores, where importing torch in four processes is most of it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from llmtrain.bench.comm_count import CommCounter

RANKS = 4


def _model() -> nn.Module:
    """Two Linears whose dim 0 (7 and 5 rows) is no multiple of RANKS, so FSDP2 pads every parameter."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5))


def _padded_numel(rows: int, numel: int) -> int:
    """FSDP2 shards dim 0 in chunks of ceil(rows / RANKS) rows, padding the last ranks' chunks to that size."""
    return math.ceil(rows / RANKS) * RANKS * (numel // rows)


def _worker(rank: int, store_path: str, results) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # four ranks share the machine's cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, RANKS), rank=rank, world_size=RANKS)
    counts = {}

    def count(name, block) -> None:
        with CommCounter() as counter:
            block()
        counts[name] = (counter.bytes, counter.calls)

    count("all_reduce", lambda: dist.all_reduce(torch.ones(1000)))
    count("all_reduce bf16", lambda: dist.all_reduce(torch.ones(33, dtype=torch.bfloat16)))
    count("all_gather", lambda: dist.all_gather_into_tensor(torch.empty(RANKS * 3, 5), torch.ones(3, 5)))
    count("all_gather list", lambda: dist.all_gather([torch.empty(6) for _ in range(RANKS)], torch.ones(6)))
    count("reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.empty(2, 3), torch.ones(RANKS * 2, 3)))
    count("reduce_scatter list", lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2)] * RANKS))
    count("broadcast", lambda: dist.broadcast(torch.ones(7, dtype=torch.float64), src=0))
    count("functional all_reduce", lambda: functional.all_reduce(torch.ones(9), "sum", dist.group.WORLD).wait())
    count("barrier", dist.barrier)
    # An op without a definition is kept under its own name, as the tensors its event shows (the list of lists
    # rank 0 gathers into does not show).
    count("gather", lambda: dist.gather(torch.ones(5), [torch.empty(5) for _ in range(RANKS)] if rank == 0 else None))

    def ring() -> None:
        ops = [
            dist.P2POp(dist.isend, torch.ones(10, dtype=torch.int64), (rank + 1) % RANKS),
            dist.P2POp(dist.irecv, torch.empty(10, dtype=torch.int64), (rank - 1) % RANKS),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    count("ring", ring)

    x = torch.randn(3, 10)
    ddp = DistributedDataParallel(_model())
    for step in (1, 2, 3):
        count(f"ddp {step}", lambda: ddp(x).sum().backward())

    sharded = _model()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    count("fsdp", lambda: sharded(x).sum().backward())

    results.put((rank, counts))
    dist.barrier()  # a rank leaving gloo while a peer still finishes a collective can abort that peer
    dist.destroy_process_group()


@pytest.mark.slow
def test_four_gloo_ranks_count_the_bytes_of_each_op(tmp_path):
    results = mp.get_context("spawn").Queue()
    from harness.processes import rank_slots  # here: the spawned ranks import this module, and only what it needs

    with rank_slots(RANKS):
        mp.start_processes(_worker, args=(str(tmp_path / "store"), results), nprocs=RANKS, start_method="spawn")
    by_rank = dict(results.get(timeout=120) for _ in range(RANKS))

    params = list(_model().parameters())
    n_params = sum(p.numel() for p in params)
    # The first backward all-reduces every gradient once (one bucket: the model is far below DDP's first-bucket
    # cap). The second forward rebuilds the buckets in the order gradients arrived and rank 0 broadcasts that
    # order: one int32 tensor of every parameter's index plus the bucket count, one of the bucket sizes.
    ddp = ({"all_reduce": 4 * n_params}, {"all_reduce": 1})
    rebuilt = (
        {"all_reduce": 4 * n_params, "broadcast": 4 * (len(params) + 1) + 4 * 1},
        {"all_reduce": 1, "broadcast": 2},
    )
    # FSDP2: each Linear all-gathers its padded parameters in forward and again in backward (only the root stays
    # unsharded after forward, and it holds none), and reduce-scatters its padded gradients once.
    padded = 4 * sum(_padded_numel(p.shape[0], p.numel()) for p in params)
    assert padded == 4 * (8 * 10 + 8 + 8 * 7 + 8)  # 7 and 5 rows each padded to 8
    for rank in range(RANKS):
        counts = by_rank[rank]
        assert counts["all_reduce"] == ({"all_reduce": 4000}, {"all_reduce": 1})
        assert counts["all_reduce bf16"] == ({"all_reduce": 66}, {"all_reduce": 1})
        assert counts["all_gather"] == ({"all_gather": RANKS * 15 * 4}, {"all_gather": 1})
        assert counts["all_gather list"] == ({"all_gather": RANKS * 6 * 4}, {"all_gather": 1})
        assert counts["reduce_scatter"] == ({"reduce_scatter": RANKS * 6 * 4}, {"reduce_scatter": 1})
        assert counts["reduce_scatter list"] == ({"reduce_scatter": RANKS * 2 * 4}, {"reduce_scatter": 1})
        assert counts["broadcast"] == ({"broadcast": 56}, {"broadcast": 1})
        assert counts["functional all_reduce"] == ({"all_reduce": 36}, {"all_reduce": 1})
        assert counts["barrier"] == ({}, {})
        assert counts["gather"] == ({"other:gather_": 20}, {"other:gather_": 1})
        assert counts["ring"] == ({"send": 80, "recv": 80}, {"send": 1, "recv": 1})
        assert [counts[f"ddp {step}"] for step in (1, 2, 3)] == [ddp, rebuilt, ddp], rank
        assert counts["fsdp"] == (
            {"all_gather": 2 * padded, "reduce_scatter": padded},
            {"all_gather": 2 * 2, "reduce_scatter": 2},
        ), rank
