"""Preference tuning (data=preference, llmtrain/data/preference.py; DPO, llmtrain/train/dpo.py): pairs rendered with
the chat template and kept together, a step's loss, rewards and gradients against a referee that computes DPO
from the definition, and every layout against one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness.corpora import write_preference_data
from harness.layouts import TWO_BLOCKS, assert_matches_single, layout_groups
from harness.preference import assert_adapter_gradients_match, preference_run, refereed_step
from omegaconf import OmegaConf

from llmtrain.config import validate
from llmtrain.data.preference import pair_of, tokenized_pairs
from llmtrain.data.sft import chat_template_of
from llmtrain.data.tokenizers import load_tokenizer
from llmtrain.errors import ConfigError
from llmtrain.process.runtime import Runtime
from llmtrain.tools import compose_config
from llmtrain.train.dpo import REWARDS, DirectPreference

ONE_PROCESS = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("pairs"))


def test_a_pair_is_its_prompt_as_context_then_each_answer_trained(pairs):
    """Text and messages give the same pair; each answer's window is the prompt (rendered with the generation
    prompt, untrained) then the answer with the template's end of turn (trained)."""
    tokenizer_dir, pairs_file = pairs
    tokenizer = load_tokenizer(compose_config(preference_run(tokenizer_dir, pairs_file)).data)
    backend = chat_template_of(tokenizer, str(tokenizer_dir))
    text = pair_of({"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."}, "record 1")
    messages = {
        "prompt": [{"role": "user", "content": "Say yes."}],
        "chosen": {"role": "assistant", "content": "Yes."},
        "rejected": [{"role": "assistant", "content": "No."}],
    }
    assert pair_of(messages, "record 2") == text
    chosen, rejected = tokenized_pairs([text], tokenizer, backend, "pairs")
    prompt = tokenizer.encode_batch(["<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"])[0]
    for marked, answer in ((chosen, "Yes."), (rejected, "No.")):
        assert np.array_equal(~marked[: len(prompt)], prompt)  # context: stored as complements (packing.untrained)
        assert (marked[len(prompt) :] >= 0).all()
        assert tokenizer.decode(marked[len(prompt) :].tolist()) == f"{answer}<|im_end|>\n"


def test_bad_pairs_and_settings_are_refused_in_one_line(pairs, tmp_path):
    with pytest.raises(ConfigError, match=r"record 7 is not a preference pair \(fields: prompt, chosen\)"):
        pair_of({"prompt": "a", "chosen": "b"}, "record 7")
    with pytest.raises(ConfigError, match="record 9: the prompt and answers need text or messages"):
        pair_of({"prompt": "a", "chosen": 5, "rejected": "c"}, "record 9")
    with pytest.raises(ConfigError, match="`chosen` and `rejected` are the assistant's answers"):
        pair_of({"prompt": "a", "chosen": {"role": "user", "content": "b"}, "rejected": "c"}, "record 8")
    base = preference_run(*pairs)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=3: data=preference trains pairs .* even"):
        validate(compose_config([*base, "train.micro_batch_size=3", "train.batch_size=6"]))
    with pytest.raises(
        ConfigError, match="data=preference compares the model with its reference, .* set model.lora.rank"
    ):
        validate(compose_config([*base, "model.lora.rank=0"]))


def test_a_dpo_step_has_the_referees_loss_rewards_and_gradients(pairs, tmp_path):
    """One process's step on adapters moved off zero: DPO's loss and rewards, recomputed from the definition (a
    copy of the model for the policy; another with its adapters zeroed for the reference; log-softmax sums), are the
    step's; the adapters' gradients of the weighted cross-entropy it trains on are autograd's of that loss."""
    from llmtrain.run.build import build_training

    beta = 0.3
    config = compose_config([*preference_run(*pairs), f"data.beta={beta}", "train.eval_every=0"])
    parts = build_training(OmegaConf.to_object(config), ONE_PROCESS, str(tmp_path / "run"))
    try:
        assert type(parts.objective) is DirectPreference  # train.objective=auto on data=preference
        step = refereed_step(parts)
    finally:
        parts.data.close()
    assert step.prepared.loss is not None
    statistics = torch.stack([step.prepared.loss, *(step.prepared.metrics[name] for name in REWARDS)])
    rewards = beta * step.log_ratios
    margins = rewards[:, 0] - rewards[:, 1]
    loss = -F.logsigmoid(margins).mean()
    loss.backward()
    expected = [loss, rewards[:, 0].mean(), rewards[:, 1].mean(), margins.mean(), (margins > 0).double().mean()]
    # a reward is β times a difference of two fp32 sums of about -200, whose unit in the last place is 1.5e-5
    assert statistics.tolist() == pytest.approx([value.item() for value in expected], rel=1e-5, abs=beta * 1.5e-5)
    assert len(REWARDS) == len(expected) - 1 and 0.0 < margins.abs().min()  # the adapters moved every answer
    assert_adapter_gradients_match(parts.model.module, step.referee)


# DPO under the layouts, against one process: pairs split over data-parallel ranks, their rows' log-probabilities
# summed over a context-parallel ring and over tensor parallelism's sequence shards, pipeline micro-batches of whole
# pairs, QLoRA's NF4 base under FSDP as the reference, and Qwen3-MoE's adapted experts over expert parallelism.
QLORA_WIDTHS = "model.d_model=256 model.n_head=4 model.n_kv_head=2 model.d_ff=512 model.quantize_base=nf4"
DPO_LAYOUTS = {
    2: [
        "parallel=ddp",
        "parallel=fsdp",
        "parallel=tp parallel.sequence_parallel=true",
        "parallel=pp parallel.microbatches=2",
        "parallel=fsdp parallel.cp=2",
        f"{QLORA_WIDTHS} parallel=fsdp",
        # a mixture of experts with adapters on every expert, the reference with them off, experts over ep 2
        "model=qwen3-moe-tiny model.lora.targets=[q_proj,experts_in,experts_out] parallel=fsdp parallel.ep=2",
    ]
}


@pytest.fixture(scope="module")
def dpo_results(tmp_path_factory, pairs) -> dict:
    tokenizer, pairs_file = pairs
    common = (
        f"data=preference data.path={pairs_file} data.tokenizer.kind=hf data.tokenizer.name={tokenizer} "
        f"data.val_fraction=0.1 model=llama-tiny {TWO_BLOCKS} model.lora.rank=4 train.seq_len=64 train.batch_size=8 "
        f"train.micro_batch_size=2 optim.warmup_steps=1 optim.lr=3e-3"
    )
    return layout_groups(tmp_path_factory, common, DPO_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", DPO_LAYOUTS[2])
def test_dpo_under_a_layout_matches_one_process(layout, dpo_results):
    assert_matches_single(dpo_results, layout)
    assert dpo_results[layout]["losses"][0] == pytest.approx(np.log(2))  # the policy starts as its reference


def test_the_planner_counts_dpos_two_forward_passes_without_gradients(pairs):
    """A DPO step computes a forward pass (a third of a training step's flops) twice more: the reference's and the
    policy's log-probabilities. Full recomputation adds its own rerun on top."""
    from llmtrain.parallel_plan import Degrees
    from llmtrain.planner.candidates import Candidate
    from llmtrain.planner.cost import layout_cost
    from llmtrain.planner.inputs import llmtrain_state_bytes, machine_for, workload_for

    def compute_seconds(*overrides: str) -> float:
        cfg = compose_config([*preference_run(*pairs), "hardware=rtx4080x4", *overrides])
        work = workload_for(cfg, 514, llmtrain_state_bytes(cfg, True))
        return layout_cost(Candidate("single", Degrees()), work, machine_for(cfg, 1, 1, True)).compute_s

    sft = ("data=sft", "train.micro_batch_size=2")
    assert compute_seconds() == pytest.approx(compute_seconds(*sft) * 5 / 3)
    recomputed = "train.activation_checkpointing=full"
    assert compute_seconds(recomputed) == pytest.approx(compute_seconds(*sft, recomputed) * 6 / 4)
