"""GRPO on the objective seam (data=rl, llmtrain/data/rl.py; train.objective=grpo, llmtrain/train/grpo_objective.py):
the prompts' rows, the rules a config must meet, a whole step (rollout, rewards, advantages, ratio, clip, KL, each
reduction) against a referee written from the definitions, a toy task whose reward rises, and every layout that
samples against one process."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
import torch
from harness.corpora import DIGIT_REWARD, RELEASED_TEMPLATES, chat_tokenizer, write_prompt_data
from harness.layouts import GROUP_WEIGHT_ATOL, layout_groups, within
from harness.preference import assert_adapter_gradients_match
from harness.runs import LOSS_RTOL
from omegaconf import OmegaConf

from llmtrain.config import validate
from llmtrain.data import RankSlice
from llmtrain.data.rl import PromptBatch, PromptBatches, PromptSet, prompt_of
from llmtrain.data.tokenizers import ByteTokenizer, FastTokenizer
from llmtrain.errors import ConfigError
from llmtrain.process.runtime import Runtime
from llmtrain.tools import compose_config
from llmtrain.train.grpo import SCALE_EPSILON, token_losses, token_shares
from llmtrain.train.grpo_objective import GroupRelative
from llmtrain.train.loop import Trainer

ONE_PROCESS = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompt_data(tmp_path_factory.mktemp("prompts"))


def rl_run(prompts_file) -> list[str]:
    """Overrides of a short run on the test prompts: 2 prompts a step, 4 completions of each, of 6 bytes at most."""
    return [
        "data=rl", f"data.path={prompts_file}", "data.tokenizer.kind=byte", "data.val_fraction=0.1", *DIGIT_REWARD,
        "model=llama-tiny", "model.n_layer=2", "train.seq_len=64", "train.batch_size=8", "train.micro_batch_size=4",
        "rl.group_size=4", "rl.max_new_tokens=6", "train.device=cpu", "logging.wandb.mode=disabled",
    ]  # fmt: skip


# -- the prompts ---------------------------------------------------------------------------------------------------
def test_a_batch_holds_each_prompt_group_times_numbered_by_its_draw():
    """Global batch k: batch_size / group prompts of the epoch's shuffle, each `group` times in a row, numbered by
    their place in the run's order of prompts; `repeats` batches alike in a row; each data-parallel rank its slice
    of that batch; a resumed reader goes on where it stopped."""
    prompts = PromptSet.of([{"prompt": f"question {i}", "answer": str(i)} for i in range(5)], ByteTokenizer(), 20, "p")
    assert prompts.stop_ids == (ByteTokenizer.eos_id,) and prompts.columns == {"answer": [str(i) for i in range(5)]}

    def batches(rank: int, dp: int, repeats: int, position=None, count: int = 4) -> list[PromptBatch]:
        reader = PromptBatches(prompts, 2, repeats, 7, RankSlice(8, 2, rank, dp), position)
        return [reader.next() for _ in range(count)]

    def slots(batch: PromptBatch) -> list[tuple[int, int]]:
        return list(zip(batch.records, batch.draws))

    whole = batches(0, 1, 1)
    assert [s.draws for s in whole[:2]] == [[0, 0, 1, 1, 2, 2, 3, 3], [4, 4, 5, 5, 6, 6, 7, 7]]
    first_epoch = [r for s in whole for r in s.records[::2]][:5]
    assert sorted(first_epoch) == list(range(5))  # every prompt once an epoch
    for s in whole:
        assert s.tokens == [prompts.tokens[r].tolist() for r in s.records]
        assert s.given == [f"question {r}" for r in s.records] and s.columns == {"answer": [str(r) for r in s.records]}
        assert s.records[::2] == s.records[1::2]  # a group's slots share their prompt
    halves = [batches(rank, 2, 1) for rank in range(2)]
    assert all(slots(a) + slots(b) == slots(w) for a, b, w in zip(*halves, whole))
    repeated = batches(0, 1, 2)
    assert slots(repeated[0]) == slots(repeated[1]) and slots(repeated[2]) == slots(whole[1])
    reader = PromptBatches(prompts, 2, 1, 7, RankSlice(8, 2, 0, 1), None)
    reader.next()
    assert slots(batches(0, 1, 1, reader.state_dict(), 1)[0]) == slots(whole[1])


def test_message_prompts_are_rendered_with_the_chat_template_and_stop_at_its_end_of_turn():
    """Qwen3's template: a prompt of messages is rendered with the generation prompt, text is taken as it is, and a
    completion stops at end-of-text or <|im_end|>; a prompt too long for its completion is left out and counted."""
    template = (RELEASED_TEMPLATES / "qwen3.jinja").read_text()
    backend = chat_tokenizer(template, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|endoftext|>")
    tokenizer = FastTokenizer(backend, backend.eos_token_id, len(backend))
    records = [
        prompt_of({"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}, "r1"),
        prompt_of({"prompt": "2+2=", "answer": "4"}, "r2"),
        prompt_of({"prompt": "a long one " * 30, "answer": "4"}, "r3"),
    ]
    prompts = PromptSet.of(records, tokenizer, 40, "prompts")
    rendered = backend.apply_chat_template(records[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompts.tokens[0].tolist()) == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(prompts.tokens[1].tolist()) == "2+2="
    assert prompts.stop_ids == (backend.eos_token_id, backend.convert_tokens_to_ids("<|im_end|>"))
    assert prompts.left_out == 1 and "1 left out" in prompts.describe()
    with pytest.raises(ConfigError, match=r"^r4 is not a prompt \(fields: question\)"):
        prompt_of({"question": "x"}, "r4")


def test_rl_settings_that_cannot_work_are_refused_in_one_line(prompts_file):
    base = rl_run(prompts_file)
    refusals = {
        "rl.group_size=3": r"train.batch_size=8 completions do not hold whole groups of rl.group_size=3: .* \(6,",
        "rl.max_new_tokens=64": r"rl.max_new_tokens=64 leaves no room for a prompt in train.seq_len=64",
        "data.reward=null": r"data=rl scores completions with data.reward, which is not set",
        "data.reward_weights=[1,2]": r"data.reward_weights holds 2 weights for 1 rewards",
        "rl.beta=0.1": r"rl.beta=0.1 penalises the distance to the reference, .* set model.lora.rank",
        "train.objective=next_token": r"train.objective=next_token with data=rl: it needs an objective of data=rl",
        "data.tokenizer.kind=bpe": r"data.tokenizer.kind=bpe trains a tokenizer on a text stream",
        "train.on_spike=skip": r"train.on_spike=skip: train.objective=grpo's loss is not a measure of progress",
        "train.attention=document": r"train.attention=document: data=rl trains on the log-probabilities the",
        "train.on_spike=rollback": r"train.on_spike=rollback: train.objective=grpo's loss is not a measure",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            validate(compose_config([*base, override]))
    validate(compose_config([*base, "data.reward=exact_number"]))  # one name, as TRL's reward_funcs takes one
    with pytest.raises(ConfigError, match=r"train.objective=grpo with data=stdlib: it needs data=rl"):
        validate(compose_config(["train.objective=grpo"]))


# -- a step against its referee ------------------------------------------------------------------------------------
def referee_log_probs(module: torch.nn.Module, rows: torch.Tensor, scored: torch.Tensor, temperature: float):
    """Each completion token's log-probability from the logits' log-softmax (divided by the temperature)."""
    logits = module(rows[:, :-1]).float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, rows[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked * scored


def referee_advantages(rows: torch.Tensor, scored: torch.Tensor, group: int) -> torch.Tensor:
    """Each completion's reward (a digit among its bytes, the stop byte aside), less its group's mean, over its
    group's standard deviation + 1e-4."""
    completions = [row[1:][mask].tolist() for row, mask in zip(rows, scored)]
    texts = [bytes(t for t in tokens if t < 256).decode("utf-8", "replace") for tokens in completions]
    rewards = torch.tensor([float(re.search("[0-9]", text) is not None) for text in texts], dtype=torch.float64)
    grouped = rewards.view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + SCALE_EPSILON)).flatten()


@pytest.mark.parametrize("loss, beta", [("dapo", 0.1), ("grpo", 0.0), ("dr_grpo", 0.04)])
def test_a_grpo_step_has_the_referees_loss_and_gradients(prompts_file, tmp_path, loss, beta):
    """Two steps on one rollout (rl.iterations=2) of LoRA adapters moved off zero: the loss and the adapters'
    gradients are those of GRPO written out on a copy of the model (log-softmax of the logits over the temperature,
    the advantages from the rewards, the ratio to the first step's log-probabilities, clipped, and the k3 KL to a
    copy with its adapters zeroed, reduced as rl.loss says); the second step reuses the rollout and clips some
    ratios (a large learning rate moved the policy)."""
    from llmtrain.run.build import build_training

    overrides = [*rl_run(prompts_file), "model.lora.rank=4", f"rl.loss={loss}", f"rl.beta={beta}", "rl.iterations=2"]
    overrides += ["rl.temperature=0.7", "rl.epsilon=0.02", "optim.lr=0.05", "optim.warmup_steps=0"]
    config = compose_config([*overrides, "train.eval_every=0"])
    parts = build_training(OmegaConf.to_object(config), ONE_PROCESS, str(tmp_path / "run"))
    module, objective = parts.model.module, parts.objective
    assert isinstance(objective, GroupRelative)  # train.objective=auto on data=rl
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    reference = copy.deepcopy(module)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("lora_b"):
                param.zero_()
    try:
        batch = parts.data.train.next()
        old = None
        for step in range(2):
            referee = copy.deepcopy(module)
            prepared = objective.prepared(batch)
            rollout = objective.current
            assert rollout is not None
            parts.model.optimizer.zero_grad(set_to_none=True)
            parts.model.forward_backward(prepared.micro_batches)
            log_probs = referee_log_probs(referee, rollout.rows, rollout.scored, 0.7).double()
            old = log_probs.detach() if old is None else old  # the policy that sampled: the first step's
            with torch.no_grad():
                ref = referee_log_probs(reference, rollout.rows, rollout.scored, 0.7).double() if beta else None
            advantage = referee_advantages(rollout.rows, rollout.scored, 4)
            expected = (
                token_losses(log_probs, old, ref, advantage, objective.settings)
                * token_shares(rollout.scored.double(), objective.settings, rollout.batch)
            ).sum()
            expected.backward()
            assert prepared.loss is not None
            assert prepared.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7), step
            assert_adapter_gradients_match(module, referee)
            record = objective.recorded({name: value.item() for name, value in prepared.metrics.items()})
            if step == 0:
                first = rollout
                assert record["clip_ratio/region_mean"] == 0 and 0 < record["reward"] < 1
                parts.model.optimizer.step()
        assert objective.current is first  # the second step trained on the first one's rollout
        assert record["clip_ratio/region_mean"] > 0 and record["entropy"] > 0
        assert ("kl" in record) == bool(beta) and record.get("kl", 1.0) > 0
    finally:
        parts.data.close()


# -- a toy task ----------------------------------------------------------------------------------------------------
@pytest.mark.slow  # seconds: a rollout and the sampler again
def test_pi_old_is_the_distribution_the_sampler_drew_from(prompts_file, tmp_path):
    """The rollout's log-probabilities (π_old: a forward pass over prompt then completion, logits over
    rl.temperature) are the sampler's own at every completion token, to 2e-5 in fp32: GRPO's ratio starts at 1 for
    what was drawn, under the attention every accepted setting trains with (data=rl refuses document masking)."""
    from llmtrain.model.kv_cache import KVCache
    from llmtrain.model.sampling import sample
    from llmtrain.parallel.sampling import laid_out_decode
    from llmtrain.run.build import build_training

    config = compose_config([*rl_run(prompts_file), "rl.temperature=0.7", "train.eval_every=0"])
    parts = build_training(OmegaConf.to_object(config), ONE_PROCESS, str(tmp_path / "run"))
    objective = parts.objective
    assert isinstance(objective, GroupRelative)
    try:
        batch = parts.data.train.next()
        objective.prepared(batch)
    finally:
        parts.data.close()
    rollout, group = objective.current, objective.group
    assert rollout is not None
    decode, seen = laid_out_decode(parts.model.module), []

    def recording(tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        logits = decode(tokens, cache)
        seen.append(logits[:, -1].float())
        return logits

    prompts = batch.every(group)
    settings = dataclasses.replace(objective.sampling, stop_ids=prompts.prompts.stop_ids)
    parts.model.module.eval()
    drawn = sample(recording, prompts.tokens, prompts.draws, group, settings, config.seed, torch.device("cpu"))
    steps = [seen[0].repeat_interleave(group, dim=0), *seen[1:]]
    compared = 0
    for row, (prompt, completion) in enumerate(zip(batch.tokens, drawn.rows())):
        for position, token in enumerate(completion):
            sampler = torch.log_softmax(steps[position][row] / 0.7, dim=-1)[token]
            assert rollout.old[row, len(prompt) - 1 + position].item() == pytest.approx(sampler.item(), abs=2e-5)
            compared += 1
    assert compared >= len(batch.tokens)


@pytest.mark.slow
def test_the_mean_reward_rises_on_a_toy_verifiable_task(prompts_file, tmp_path):
    """A digit anywhere in a 4-byte completion: a random tiny model earns it about 1 time in 5; 24 steps of GRPO
    (8 completions of each of 4 prompts) bring the mean reward close to 1. The update guard, judging against a
    window of 3 steps, finds no spike in GRPO's signed loss (it judges none: the objective's row)."""
    from llmtrain.run.build import build_training

    overrides = [*rl_run(prompts_file), "model=tiny", "rl.max_new_tokens=4", "rl.group_size=8"]
    overrides += ["train.batch_size=32", "train.micro_batch_size=16", "optim.lr=3e-3", "optim.warmup_steps=0"]
    config = compose_config([*overrides, "train.steps=24", "train.eval_every=0", "train.spike_window=3"])
    parts = build_training(OmegaConf.to_object(config), ONE_PROCESS, str(tmp_path / "run"))
    records: list[dict] = []
    try:
        trainer = Trainer(parts, records.append)
        parts.model.module.train()
        for _ in range(24):
            trainer.advance()
    finally:
        parts.data.close()
    rewards = [record["reward"] for record in records]
    assert np.mean(rewards[:3]) < 0.4 and np.mean(rewards[-3:]) > 0.85, rewards
    assert not [record["step"] for record in records if record.get("spike") or record.get("skipped")]


# -- every layout that samples -------------------------------------------------------------------------------------
# GRPO under the layouts, against one process, two steps on one rollout (the second's ratios away from 1):
# completions drawn on each data-parallel rank from its own prompts, FSDP gathering the whole model once (the
# planner's choice here) or its blocks for every decoded token, tensor parallelism's heads (and its vocabulary-
# sharded loss), adapters with the KL term to the base, and QLoRA's NF4 base under FSDP.
QLORA_WIDTHS = "model.d_model=256 model.n_head=4 model.n_kv_head=2 model.d_ff=512 model.quantize_base=nf4"
GRPO_LAYOUTS = {
    2: [
        "parallel=ddp",
        "parallel=fsdp",
        "parallel=fsdp rl.gather_weights=per_token",
        "parallel=tp parallel.sequence_parallel=false parallel.loss_parallel=true",
        "model.lora.rank=4 rl.beta=0.1 parallel=fsdp",
        f"{QLORA_WIDTHS} model.lora.rank=4 rl.beta=0.1 parallel=fsdp",
    ],
    4: ["parallel=fsdp_tp parallel.sequence_parallel=false"],
}


@pytest.fixture(scope="module")
def grpo_results(tmp_path_factory, prompts_file) -> dict:
    common = " ".join(
        [*rl_run(prompts_file), "rl.iterations=2", "rl.epsilon=0.02", "optim.lr=0.001", "optim.warmup_steps=0"]
    )
    return layout_groups(tmp_path_factory, common, GRPO_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [layout for layouts in GRPO_LAYOUTS.values() for layout in layouts])
def test_grpo_under_a_layout_matches_one_process(layout, grpo_results):
    """The same completions (so the same rewards, on every step and at validation), the same losses (GRPO's reads
    ~0 on a rollout's first step: compared within LOSS_RTOL of the gradient norm's scale), gradient norms within
    LOSS_RTOL and weights within GROUP_WEIGHT_ATOL."""
    from layout_worker import reference_name

    reference, run = grpo_results[reference_name(layout)], grpo_results[layout]
    assert run["rewards"] == reference["rewards"] and run["val_rewards"] == reference["val_rewards"], layout
    assert run["norms"] == pytest.approx(reference["norms"], rel=LOSS_RTOL), layout
    assert run["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL, abs=1e-7), layout
    assert run["same_names"] and within(run["weight_difference"], GROUP_WEIGHT_ATOL), layout


# -- the planner ----------------------------------------------------------------------------------------------------
def test_the_planners_kv_cache_is_the_one_the_sampler_allocates():
    """planner/rollout.py's cache bytes for a rank's rows are what the sampler's KVCache holds after a rollout of
    llama-tiny (grouped-query: 2 key/value heads of 4), prompts of one length, fp32."""
    from llmtrain.model import GPT, gpt_config
    from llmtrain.model.kv_cache import KVCache
    from llmtrain.model.sampling import SamplingSettings, sample
    from llmtrain.parallel_plan import Degrees
    from llmtrain.planner.rollout import RolloutRank, kv_cache_bytes

    cfg = compose_config(["model=llama-tiny", "model.n_layer=2"])
    model = GPT(gpt_config(cfg.model, 61)).eval()
    step, caches = model.decode, []

    def decode(tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        caches.append(cache)
        return step(tokens, cache)

    prompts, group, new_tokens = [[1, 2, 3, 4, 5]] * 3, 4, 6
    settings = SamplingSettings(max_new_tokens=new_tokens)
    sample(decode, prompts, range(3), group, settings, 0, torch.device("cpu"))
    rank = RolloutRank(rows=3 * group, prompts=3, prompt_tokens=5, new_tokens=new_tokens)
    assert kv_cache_bytes(model.cfg, Degrees(), rank, 4) == caches[-1].nbytes > 0


def test_the_planner_splits_a_grpo_step_and_gathers_once_where_the_model_fits(prompts_file):
    """A GRPO step's prediction holds its rollout: a layout that cannot sample never fits; under FSDP the rollout
    gathers the whole model once where it fits beside the cache (`auto`), which beats gathering every block for
    each decoded token over 4080s' PCIe; where it does not fit, block by block; the cache is counted in a rank's
    peak, and both grow with longer completions; parallel=auto weighs only the layouts that sample."""
    from llmtrain.planner.auto import auto_plans, configured_cost
    from llmtrain.planner.rollout import unsampled

    def config(model: str, *overrides: str):
        run = [o for o in rl_run(prompts_file) if not o.startswith("model")] + [model, "hardware=rtx4080x4"]
        run.append("train.seq_len=512")
        run += ["rl.max_new_tokens=256", "train.batch_size=64", "model.lora.rank=16", "parallel=fsdp"]
        return compose_config([*run, *overrides])

    def cost(model: str, *overrides: str):
        return configured_cost(config(model, *overrides), 4, 4, 151936, True)

    once, per_token = cost("model=qwen3-1.7b"), cost("model=qwen3-1.7b", "rl.gather_weights=per_token")
    assert once.gathers_once and not per_token.gathers_once and 0 < once.sampling_s < per_token.sampling_s
    assert per_token.heaviest.sampling < once.heaviest.sampling
    assert cost("model=qwen3-1.7b", "parallel=pp").unmodelled is not None
    big = cost("model=qwen3-8b")
    assert not big.gathers_once  # 16 GB of bf16 weights do not fit a 16 GB card
    longer = cost("model=qwen3-1.7b", "train.seq_len=768", "rl.max_new_tokens=512")
    assert longer.sampling_s > once.sampling_s and longer.heaviest.sampling > once.heaviest.sampling
    weighed, _ = auto_plans(config("model=qwen3-1.7b", "parallel=auto"), 4, 4, 151936, True, "1f1b")
    assert {p.candidate.degrees.tp for p in weighed} == {1, 2, 4}  # parallel=auto weighs only layouts that sample
    assert all(unsampled(p.candidate.degrees, p.candidate.sequence_parallel) is None for p in weighed)
