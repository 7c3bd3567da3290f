"""Tensor, sequence and loss parallelism, and 2-D FSDP x TP, reproduce `single` (real gloo processes on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from harness.layouts import layout_plan
from harness.paths import REPO
from harness.processes import free_port, join_as_rank, json_lines, rank_slots, torchrun
from harness.runs import PARITY, assert_parity

from llmtrain.errors import ConfigError
from llmtrain.model import build_model, cross_entropy_loss
from llmtrain.tools import compose_config
from llmtrain.tools.compare_runs import compare

pytestmark = pytest.mark.slow


# tp with and without sequence parallelism, fsdp_tp and pp_tp, with recomputation, run with the other layouts of
# GPT-2's family in test_parallel.py's process groups; here, what tensor parallelism alone must also get right.
def test_dropout_masks_follow_the_data_not_the_split(reference, train):
    """Dropout on (residual and attention weights): tensor + sequence parallel with recomputed blocks drops exactly
    what one process drops with the same micro-batches, each rank hashing only its own elements' indices."""
    dropout = ["model.dropout=0.1", "model.attention_dropout=0.1", "train.micro_batch_size=8"]
    single = train(*PARITY, *dropout, name="single_dropout")
    split = train(
        *PARITY,
        *dropout,
        "parallel=tp",
        "parallel.sequence_parallel=true",
        "train.activation_checkpointing=full",
        nproc=2,
        name="tp_dropout",
    )
    assert_parity(split, single)
    assert compare(str(single.run_dir), str(reference.run_dir))["loss"] > 1e-3  # dropout did change the run


def test_compiled_blocks_with_selective_recomputation_do_not_change_the_loss(reference, train):
    """Compiled blocks that recompute selectively: the checkpoint sits inside the compiled block (checkpointing a
    compiled block from outside fails in backward with "Tensor cached ... has been mutated"). Compilation did
    happen (a run that silently ran eagerly would match as well): the summary counts dynamo's graphs."""
    run = train(*PARITY, "train.compile=true", "train.activation_checkpointing=selective")
    assert_parity(run, reference)
    assert run.summary["compiled_graphs"] >= 1 and "graphs compiled" in run.stdout + run.stderr


def _logits_worker(rank: int, port: int, results) -> None:
    join_as_rank(rank, 2, port)
    from hydra import compose, initialize_config_dir

    from llmtrain.config import register_schemas
    from llmtrain.model import cross_entropy_loss
    from llmtrain.process.runtime import init_runtime
    from llmtrain.run.build import build_parallel_model

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["parallel=tp", "parallel.sequence_parallel=true", "train.seq_len=16"])
    runtime = init_runtime("cpu")
    model = build_parallel_model(cfg, runtime, 257)
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(1))
    seen = []
    model.module.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(tuple(out.to_local().shape)))
    with model.loss_context():
        loss = cross_entropy_loss(model.module(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    results.put((rank, seen[0], type(loss).__name__, loss.full_tensor().item()))
    runtime.shutdown(synchronize=True)


def test_loss_parallel_never_materialises_full_vocabulary_logits():
    results = mp.get_context("spawn").Queue()
    with rank_slots(2):
        mp.start_processes(_logits_worker, args=(free_port(), results), nprocs=2, start_method="spawn")
    (_, shape0, kind, loss0), (_, shape1, _, loss1) = sorted(results.get(timeout=120) for _ in range(2))
    padded_vocab = 320  # 257 byte tokens padded to a multiple of 64
    assert shape0 == shape1 == (2, 16, padded_vocab // 2)
    # the vocabulary-sharded loss is the unsplit model's on the same tokens (not merely the same on both ranks)
    cfg = compose_config(["train.seq_len=16"])
    whole = build_model(cfg.model, 257, seed=cfg.seed)
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = cross_entropy_loss(whole(tokens[:, :-1]), tokens[:, 1:]).item()
    assert kind == "DTensor" and loss0 == loss1 == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def tp_comms() -> dict[tuple[bool, str], dict]:
    """llmtrain.bench.tp_comms over 2 ranks: the collectives per block of each setting of sequence parallelism
    and recomputation."""
    rows = json_lines(torchrun(2, "-m", "llmtrain.bench.tp_comms").stdout)
    return {(row["sequence_parallel"], row["recompute"]): row for row in rows}


# Megatron-LM's tensor parallelism, per transformer block, one micro-batch, forward + backward (Shoeybi et al. 2019,
# "Megatron-LM", section 3: figure 3's conjugate operators f and g, figure 4's 4 communications per layer;
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2: sequence
# parallelism, its operators g and g-bar).
# - Without sequence parallelism, attention and the MLP are each a column-parallel matmul followed by a
#   row-parallel one. g closes each pair: an all-reduce of the row-parallel matmul's partial sums in forward
#   (identity in backward); f opens it: identity in forward, an all-reduce of the input's gradient in backward.
#   2 all-reduces forward + 2 backward = 4.
# - With sequence parallelism, the activations between the pairs are split along the sequence: g becomes a
#   reduce-scatter in forward (an all-gather in backward: g-bar) and f an all-gather in forward (a reduce-scatter in
#   backward: Korthikanti's g). Forward 2 all-gathers + 2 reduce-scatters, backward the mirror: 4 + 4.
# - Recomputed selectively, the policy (llmtrain/model/recompute.py) keeps the matmuls' outputs and the all-reduces'
#   and reduce-scatters' outputs, so backward's replay of the block repeats no reduction: still 4 all-reduces
#   without sequence parallelism. It does repeat the 2 all-gathers (their sequence-long outputs are not kept, as
#   Megatron-LM's sequence parallelism gathers again in backward): the column-parallel matmuls' weight gradients
#   need them: 4 + 2 = 6 all-gathers, 4 reduce-scatters.
# - Recomputed in full, backward replays the block's forward only up to the last tensor its backward needs (torch's
#   non-reentrant checkpoint stops there): both all-gathers and attention's reduce-scatter, not the MLP's closing
#   one, whose output nothing in the block's backward reads: 6 all-gathers, 4 + 1 = 5 reduce-scatters.
# Counted by the names torch's functional collectives carry.
COLLECTIVES_PER_BLOCK: dict[tuple[bool, str], dict[str, int]] = {
    # (sequence parallelism, train.activation_checkpointing)
    (False, "none"): {"all_reduce": 4},
    (False, "selective"): {"all_reduce": 4},
    (True, "none"): {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4},
    (True, "selective"): {"all_gather_into_tensor": 6, "reduce_scatter_tensor": 4},
    (True, "full"): {"all_gather_into_tensor": 6, "reduce_scatter_tensor": 5},
}


@pytest.mark.parametrize("setting", COLLECTIVES_PER_BLOCK, ids=lambda s: f"sp={s[0]}-{s[1]}")
def test_collectives_per_layer_match_the_design(setting: tuple[bool, str], tp_comms) -> None:
    """Megatron's collectives per block; recomputed selectively, backward replays no reduction (the policy keeps
    their outputs: over PCIe a reduction done twice is a step's most expensive waste), where a full recomputation
    replays one."""
    measured = {op: n for op, n in tp_comms[setting]["per_block"].items() if n}
    assert measured == COLLECTIVES_PER_BLOCK[setting], tp_comms[setting]


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel=tp", "model.n_head=6", "model.d_model=132"], 4, "model.n_head=6"),
        (["parallel=tp", "parallel.sequence_parallel=true", "train.seq_len=63"], 2, "train.seq_len=63"),
        (["parallel=tp", "parallel.tp=4"], 2, "parallel.tp=4"),
        # SwiGLU's width is 8/3 x 96 rounded up to 256, which 3 does not divide (4 x 96 would be)
        (["parallel=tp", "model.mlp=swiglu", "model.d_model=96", "model.n_head=3"], 3, "the MLP width 256"),
    ],
)
def test_bad_tensor_parallel_config_is_refused(overrides, world_size, message):
    with pytest.raises(ConfigError) as error:
        layout_plan(*overrides, world_size=world_size)
    assert message in str(error.value) and "\n" not in str(error.value)
