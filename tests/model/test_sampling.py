"""The KV-cached sampler (llmtrain/model/sampling.py, kv_cache.py): its logits are the whole forward pass's, a
completion depends on its prompt, seed and model alone (not on the batch or its padding), and the draws follow the
filtered softmax."""

from __future__ import annotations

import pytest
import torch

from llmtrain.model import GPT, GPTConfig
from llmtrain.model.kv_cache import KVCache
from llmtrain.model.sampling import SamplingSettings, draw, sample

CPU = torch.device("cpu")
SHAPES = {
    "gpt2": {},
    "llama": {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "n_kv_head": 2, "bias": False},
    "gemma3 windows": {
        "norm": "offset_rmsnorm", "position": "rope", "mlp": "geglu", "n_kv_head": 2, "bias": False, "qk_norm": True,
        "sandwich_norm": True, "sliding_window": (3, 0), "rope_local_theta": 100.0,
    },
}  # fmt: skip
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [1]]


def _model(shape: str, sharpness: float = 40.0) -> GPT:
    """A seeded model whose head is scaled by `sharpness`: logits far from uniform, so that a wrong one would
    change the tokens drawn."""
    model = GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, max_seq_len=32, **SHAPES[shape]))
    model.init_weights(0)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model.eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_cached_step_has_the_whole_forward_passs_logits(shape):
    """Prompts of three lengths left-padded into one prefill, each drawn twice from its prefill: every completion's
    logits, position by position, are those of the whole sequence run at once (within fp32 rounding), windows and
    grouped-query attention included."""
    model = _model(shape)
    completions = sample(model.decode, PROMPTS, [0, 1, 2], 2, SamplingSettings(6), seed=3, device=CPU)
    seen: list[torch.Tensor] = []
    decode = model.decode

    def recording(tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        logits = decode(tokens, cache)
        seen.append(logits[:, -1])
        return logits

    again = sample(recording, PROMPTS, [0, 1, 2], 2, SamplingSettings(6), seed=3, device=CPU)
    assert again.rows() == completions.rows()
    stepped = torch.stack([seen[0].repeat_interleave(2, dim=0), *seen[1:]], dim=1)  # (rows, position, vocabulary)
    for row, completion in enumerate(completions.rows()):
        prompt = PROMPTS[row // 2]
        with torch.no_grad():
            whole = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(stepped[row, : len(completion)], whole, rtol=0, atol=2e-5)


def test_a_completion_depends_on_its_prompt_seed_and_model_alone():
    """Each prompt alone draws what it draws in a batch with the others (other padding, other rows); the same seed
    draws the same, another seed other completions."""
    model = _model("llama", sharpness=4.0)
    settings = SamplingSettings(8, temperature=1.0, top_k=20, top_p=0.9)
    batched = sample(model.decode, PROMPTS, [10, 11, 12], 3, settings, seed=7, device=CPU).rows()
    alone = [
        row
        for index, prompt in enumerate(PROMPTS)
        for row in sample(model.decode, [prompt], [10 + index], 3, settings, seed=7, device=CPU).rows()
    ]
    assert batched == alone
    assert len({tuple(row) for row in batched}) > len(PROMPTS)  # a group's completions differ
    other = sample(model.decode, PROMPTS, [10, 11, 12], 3, settings, seed=8, device=CPU).rows()
    assert other != batched


def test_a_row_ends_after_a_stop_token_which_it_keeps():
    """Greedy decoding (temperature 0) is the whole model's argmax step by step; a stop token ends its row, kept
    and counted in its length, while the other rows go on to max_new_tokens."""
    model = _model("gpt2")
    greedy = sample(model.decode, PROMPTS, [0, 1, 2], 1, SamplingSettings(6, temperature=0), 0, CPU).rows()
    for prompt, completion in zip(PROMPTS, greedy):
        ids = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert completion == ids[len(prompt) :]
    stop = greedy[1][2]
    settings = SamplingSettings(6, temperature=0, stop_ids=(stop,))
    ended = sample(model.decode, PROMPTS, [0, 1, 2], 1, settings, 0, CPU)
    assert ended.rows()[1] == greedy[1][: greedy[1].index(stop) + 1] and bool(ended.stopped[1])
    for row, completion in enumerate(greedy):
        if stop not in completion:
            assert ended.rows()[row] == completion and not bool(ended.stopped[row])


def test_the_sampler_sees_the_current_adapters():
    """With low-rank adapters moved off zero, the adapted model draws what the same model with its adapters merged
    into its weights draws, not what its base draws: no copy or merge is needed to sample from the policy."""
    import dataclasses

    from llmtrain.model.hf_peft import merged
    from llmtrain.model.lora import LoRAConfig

    cfg = GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, max_seq_len=32, **SHAPES["llama"])
    adapted = GPT(dataclasses.replace(cfg, lora=LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "fc_out"))))
    adapted.init_weights(0)
    with torch.no_grad():
        adapted.lm_head.weight.mul_(4)
        generator = torch.Generator().manual_seed(1)
        for name, param in adapted.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator))
    settings = SamplingSettings(8)
    drawn = sample(adapted.eval().decode, PROMPTS, [0, 1, 2], 2, settings, seed=1, device=CPU).rows()
    base = GPT(cfg)
    base.init_weights(0)
    with torch.no_grad():
        base.lm_head.weight.mul_(4)
    assert drawn == sample(merged(adapted).decode, PROMPTS, [0, 1, 2], 2, settings, seed=1, device=CPU).rows()
    assert drawn != sample(base.eval().decode, PROMPTS, [0, 1, 2], 2, settings, seed=1, device=CPU).rows()


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [(0, 1.0, [0.5, 0.25, 0.15, 0.1]), (2, 1.0, [2 / 3, 1 / 3, 0, 0]), (0, 0.7, [2 / 3, 1 / 3, 0, 0])],
)
def test_draws_follow_the_filtered_softmax(top_k, top_p, kept):
    """4,000 rows' seeds drawing from probabilities (0.5, 0.25, 0.15, 0.1): each token's share is its probability
    after top-k or top-p renormalised (top-p 0.7: the fewest tokens reaching it), within 3 standard errors."""
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log().repeat(4000, 1)
    seeds = torch.arange(4000, dtype=torch.long) * 7919 + 11
    drawn = draw(logits, SamplingSettings(1, temperature=1.0, top_k=top_k, top_p=top_p), seeds, position=0)
    shares = torch.bincount(drawn, minlength=4).double() / 4000
    for share, expected in zip(shares.tolist(), kept):
        assert abs(share - expected) <= 3 * (expected * (1 - expected) / 4000) ** 0.5 + 1e-9


# The layouts that sample, on 2 ranks, against one process: data-parallel ranks drawing their own prompts, FSDP
# gathering each block per step, tensor-parallel ranks each over its own heads (and the logits gathered from the
# vocabulary shards), LoRA's adapters and an NF4 base beside them.
SAMPLING_LAYOUTS = [
    "parallel=ddp",
    "parallel=fsdp",
    "parallel=tp parallel.sequence_parallel=false",
    "parallel=tp parallel.sequence_parallel=false parallel.loss_parallel=true",
    "model.lora.rank=4 parallel=fsdp",
    "model.d_model=256 model.n_head=4 model.n_kv_head=2 model.d_ff=512 model.lora.rank=4 model.quantize_base=nf4 "
    "parallel=fsdp",
]


@pytest.mark.slow
def test_every_layout_that_samples_draws_what_one_process_draws(tmp_path):
    """The same seed, the same completions: llama-tiny (grouped-query attention, rotary positions) under each layout
    draws every prompt's group token for token as the unsplit model does, and computes every completion token's
    log-probability as it does (within fp32 sums in other orders)."""
    import json

    from harness.paths import WORKERS
    from harness.processes import torchrun
    from sampling_worker import model_overrides

    common = "model=llama-tiny model.n_layer=2 model.vocab_size=61 train.device=cpu logging.wandb.mode=disabled"
    torchrun(2, str(WORKERS / "sampling_worker.py"), str(tmp_path), common, *SAMPLING_LAYOUTS, timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    single = results["single"]["completions"]
    assert len(single) == 6 and len({tuple(row) for rows in single for row in rows}) > 6
    for layout in SAMPLING_LAYOUTS:
        reference = results[f"single {model_overrides(layout)}".strip()]
        assert results[layout]["completions"] == reference["completions"], layout
        for ours, theirs in zip(results[layout]["log_probs"], reference["log_probs"]):
            for mine, expected in zip(ours, theirs):
                assert mine == pytest.approx(expected, abs=2e-5), layout


def test_a_layout_that_cannot_sample_is_refused_in_one_line():
    from llmtrain.errors import ConfigError
    from llmtrain.parallel_plan import ParallelPlan, check_samples
    from llmtrain.tools import compose_config

    for overrides, refusal in (
        (["parallel=pp"], r"^parallel=pp: a pipeline cannot sample"),
        (["parallel=fsdp", "parallel.cp=2"], r"^parallel.cp=2: decoding one position at a time"),
        (["parallel=tp", "parallel.sequence_parallel=true"], r"^parallel.sequence_parallel=true: a decoding step"),
    ):
        config = compose_config(["model=llama-tiny", "train.batch_size=8", "train.micro_batch_size=2", *overrides])
        plan = ParallelPlan.of(config.parallel, config.train, config.model, 2)
        with pytest.raises(ConfigError, match=refusal) as refused:
            check_samples(plan)
        assert "\n" not in str(refused.value)


@pytest.mark.slow  # seconds: transformers' import
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "qwen3-tiny"])
def test_greedy_batches_decode_what_transformers_generate_decodes(preset):
    """Left-padded prompts of three lengths, decoded greedily for 12 tokens by the sampler and by transformers'
    generate (its cache and attention mask) on the same model converted as llmtrain.export converts it: the same
    tokens (the benchmark's two sides, llmtrain/bench/sampling.py)."""
    from llmtrain.bench.sampling import _ours, _theirs
    from llmtrain.export import hf_model_of
    from llmtrain.model import build_model
    from llmtrain.tools import compose_config

    model = build_model(compose_config([f"model={preset}", "model.vocab_size=257"]).model, 257, seed=0).eval()
    with torch.no_grad():  # far from uniform, so that a near tie cannot decide a token
        model.lm_head.weight.mul_(8)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    cpu = torch.device("cpu")
    _, ours = _ours(model, prompts, 12, cpu)
    _, theirs = _theirs(hf_model_of(model, eos_id=256), prompts, 12, cpu)
    assert ours == theirs


def test_every_family_offers_the_decoding_contract_and_a_model_without_it_says_so():
    """generate, the chat and GRPO's rollouts decode through LayeredModel's context_length, vocab_size and decode
    alone: every catalog family implements them, and a model that does not is refused with a line naming them (not
    an AttributeError deep in a decoding loop)."""
    from importlib import import_module

    from llmtrain.catalog.models import MODEL_FAMILIES
    from llmtrain.model.base import LayeredModel
    from llmtrain.parallel.sampling import laid_out_decode

    for name, row in MODEL_FAMILIES.items():
        module, _, attribute = row.model.partition(":")
        family = getattr(import_module(module), attribute)
        for member in ("context_length", "vocab_size", "decode"):
            assert getattr(family, member) is not getattr(LayeredModel, member), f"{name} lacks {member}"
    model = _model("llama")
    assert (model.context_length, model.vocab_size) == (32, 97)

    class Silent(LayeredModel):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleDict()

    with pytest.raises(NotImplementedError, match="Silent does not decode: implement LayeredModel's context_length"):
        sample(laid_out_decode(Silent()), PROMPTS, [0, 1, 2], 1, SamplingSettings(2), seed=0, device=CPU)


def test_the_cache_grows_with_what_is_written_not_with_the_context():
    """A 131,072-token context's cache holds what its rows wrote (doubling from 256 columns: 100 -> 256, 300 -> 512,
    600 -> 1,024), keeps every key across a growth, and each step's attention is causal attention over them all."""
    import torch.nn.functional as F

    cache = KVCache(torch.zeros(2, dtype=torch.long), 131_072)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    generator = torch.Generator().manual_seed(0)
    for t, columns in ((100, 256), (200, 512), (300, 1024)):
        q, k, v = (torch.randn(2, 2, t, 8, generator=generator) for _ in range(3))
        got = cache.attend(0, q, k, v, None)
        keys.append(k)
        values.append(v)
        end = cache.filled + t
        seen = torch.arange(end)[None, :] <= torch.arange(cache.filled, end)[:, None]
        expected = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=seen)
        torch.testing.assert_close(got, expected)
        cache.advance(t)
        assert cache.nbytes == 2 * (2 * 2 * columns * 8) * 4  # keys and values, fp32
