"""The families people fine-tune and run RL from, beyond GPT-2, Llama, Qwen3, Gemma 3 and the mixtures: Qwen2 /
Qwen2.5 (query, key and value biases), Mistral (one sliding window in every block), SmolLM3 (every fourth block
without rotary positions) and OLMo 2 (norms after each branch, over the whole query and key projections). For each:
its presets' parameter counts are transformers', our tiny preset exports into transformers' class with our logits,
greedy decoding from a transformers checkpoint draws transformers' own tokens, and the real-size preset fits four
16 GB cards under QLoRA. Their logits from `model.init_from` alone: tests/model/test_init_from_alone.py."""

from __future__ import annotations

import pytest
import torch
from harness.hf_families import LOGIT_ATOL, VOCAB, saved_hf_model
from harness.layouts import LORA, QLORA

from llmtrain.model import build_model, meta_model, num_parameters
from llmtrain.model.hf import hf_format_of
from llmtrain.tools import compose_config

# model_type -> (its tiny preset, its real-size preset)
RELEASED = {
    "qwen2": ("qwen2.5-tiny", "qwen2.5-1.5b"),
    "mistral": ("mistral-tiny", "mistral-7b-v0.3"),
    "smollm3": ("smollm3-tiny", "smollm3-3b"),
    "olmo2": ("olmo2-tiny", "olmo2-1b"),
}
# The real-size presets' parameters in billions, as their releases' model cards round them
BILLIONS = {"qwen2.5-1.5b": 1.54, "mistral-7b-v0.3": 7.25, "smollm3-3b": 3.08, "olmo2-1b": 1.48}


def transformers_model(cfg, device: str = "meta"):
    import transformers

    chosen = hf_format_of(cfg)
    with torch.device(device):
        return getattr(transformers, chosen.transformers_class)(chosen.hf_config(cfg, 0)), chosen


@pytest.mark.parametrize("preset", [preset for pair in RELEASED.values() for preset in pair])
def test_the_presets_hold_transformers_parameter_count(preset):
    ours = meta_model(compose_config([f"model={preset}"]).model, VOCAB)
    theirs, _ = transformers_model(ours.cfg)
    assert num_parameters(ours) - ours.cfg.padding_parameters == theirs.num_parameters()
    if preset in BILLIONS:
        assert round(theirs.num_parameters() / 1e9, 2) == BILLIONS[preset]


@pytest.mark.parametrize("model_type", list(RELEASED))
def test_our_tiny_preset_exports_into_transformers_with_our_logits(model_type):
    """The export's map and config: the family's transformers class takes every tensor of our model (strictly) and
    computes our logits, over more positions than Mistral's window holds."""
    cfg = compose_config([f"model={RELEASED[model_type][0]}"]).model
    ours = build_model(cfg, VOCAB, seed=3).eval()
    with torch.no_grad():  # norms and biases away from their initial values, so that one read wrongly shows
        for name, param in ours.named_parameters():
            if name != "lm_head.bias":  # the padded vocabulary's mask, no weight
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    theirs, chosen = transformers_model(ours.cfg, "cpu")
    assert chosen.model_type == model_type
    theirs.load_state_dict(chosen.state_dict(ours), strict=True)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs.eval()(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # writes and reads a model directory
@pytest.mark.parametrize("model_type", list(RELEASED))
def test_greedy_decoding_from_a_transformers_checkpoint_draws_its_tokens(tmp_path, model_type):
    """Our KV-cached sampler, greedy, from `model.init_from` of a transformers model: the tokens its own `generate`
    draws, past Mistral's window and through SmolLM3's unrotated block."""
    from llmtrain.generate import continuations
    from llmtrain.model.hf_adopted import with_init_from_model
    from llmtrain.model.sampling import SamplingSettings

    theirs = saved_hf_model(tmp_path, model_type)
    overrides = [f"model.init_from={tmp_path}"]
    ours = build_model(with_init_from_model(compose_config(overrides), overrides).model, VOCAB, seed=1).eval()
    prompts = [[5, 17, 99, 3, 42, 7], [200, 1, 64]]
    drawn = continuations(ours, prompts, SamplingSettings(20, 0.0, 0, 1.0, ()), seed=0, eos_id=None)
    for prompt, new in zip(prompts, drawn):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # every token attended (generate masks those equal to the config's pad id, OLMo 2's 1)
            expected = theirs.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, eos_token_id=None
            )
        assert new == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("model_type", list(RELEASED))
def test_the_real_size_preset_fits_four_16_gb_cards_under_qlora(model_type):
    from llmtrain.planner.auto import configured_cost

    preset = RELEASED[model_type][1]
    overrides = [f"model={preset}", "model.lora.rank=16", "model.quantize_base=nf4", "train.seq_len=2048",
                 "train.batch_size=8", "train.micro_batch_size=1", "train.activation_checkpointing=full",
                 "hardware=rtx4080x4", "data.tokenizer.kind=byte", "parallel=fsdp"]  # fmt: skip
    cfg = compose_config(overrides)
    cost = configured_cost(cfg, 4, 4, cfg.model.vocab_size, True)
    assert cost.fits and cost.heaviest.total < 15 * 2**30, (preset, cost.heaviest)


# Two blocks (the group's): SmolLM3's second unrotated, Mistral's window shorter than the 32-token sequence
SMOLLM3, MISTRAL = "model=smollm3-tiny model.rope_layers=[1,0]", "model=mistral-tiny model.sliding_window=[8]"
# Each family fine-tuned with adapters under tensor parallelism (OLMo 2's query and key norms over projections split
# by heads: their squares summed over the ranks) and with an NF4 base under FSDP (QLoRA), against one process.
FAMILY_LAYOUTS = [
    f"model=qwen2.5-tiny {LORA} parallel=tp",
    f"model=qwen2.5-tiny {QLORA} parallel=fsdp",
    f"{MISTRAL} {LORA} parallel=tp parallel.sequence_parallel=true",
    f"{MISTRAL} {QLORA} parallel=fsdp",
    f"{SMOLLM3} {LORA} parallel=tp",
    f"{SMOLLM3} {QLORA} parallel=fsdp",
    f"model=olmo2-tiny {LORA} parallel=tp parallel.sequence_parallel=true",
    "model=olmo2-tiny parallel=fsdp_tp",
    f"model=olmo2-tiny {QLORA} parallel=fsdp",
]


@pytest.fixture(scope="module")
def family_results(tmp_path_factory) -> dict:
    from harness.layouts import GROUP_RUN, layout_group

    return layout_group(tmp_path_factory, 2, GROUP_RUN, FAMILY_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", FAMILY_LAYOUTS)
def test_each_family_fine_tuned_under_a_layout_matches_one_process(layout, family_results):
    from harness.layouts import assert_matches_single

    assert_matches_single(family_results, layout)


@pytest.mark.slow  # writes and reads an adapter directory
@pytest.mark.parametrize("preset", [*(tiny for tiny, _ in RELEASED.values()), "gemma3-tiny"])
def test_peft_puts_our_exported_adapters_onto_transformers_with_our_logits(tmp_path, preset):
    """Adapters on every projection, exported in PEFT's format: PEFT puts them onto the family's transformers class
    holding our base, and the two compute our adapted model's logits."""
    from dataclasses import replace

    from llmtrain.model.hf_peft import save_peft_adapter
    from llmtrain.model.lora import LoRAConfig, is_adapter

    peft = pytest.importorskip("peft", reason="the peft extra: pip install -e '.[peft]'")
    ours = build_model(compose_config([f"model={preset}", LORA]).model, VOCAB, seed=1).eval()
    with torch.no_grad():  # B away from zero: the adapters change the logits
        for name, param in ours.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    base = type(ours)(replace(ours.cfg, lora=LoRAConfig()))
    base.load_state_dict({k: v for k, v in ours.state_dict().items() if not is_adapter(k)})
    theirs, chosen = transformers_model(base.cfg, "cpu")
    theirs.load_state_dict(chosen.state_dict(base), strict=True)
    save_peft_adapter(ours, None, str(tmp_path / "adapter"))
    adapted = peft.PeftModel.from_pretrained(theirs, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (adapted(ids).logits - ours(ids)[..., :VOCAB]).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(RELEASED))
def test_a_transformers_checkpoint_trains_exports_and_generates_by_its_config_alone(
    tmp_path, train, monkeypatch, capsys, model_type
):
    """A random-weight transformers model saved to a directory: `train.py model.init_from=<dir>`, no `model=`,
    fine-tunes it with adapters; llmtrain.export writes the family's transformers class again, which
    llmtrain.generate continues a prompt from."""
    import json
    import subprocess
    import sys

    from harness.processes import python
    from harness.runs import FAST

    from llmtrain.generate import main as generate

    saved_hf_model(tmp_path / "base", model_type)
    unpreset = [override for override in FAST if not override.startswith("model=")]
    run = train(
        *unpreset, f"model.init_from={tmp_path / 'base'}", LORA, "train.steps=2", "train.seq_len=32", fast=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    exported = tmp_path / "exported"
    done = subprocess.run(
        [python(), "-m", "llmtrain.export", str(run.run_dir), str(exported)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((exported / "config.json").read_text())["model_type"] == model_type
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["generate", str(exported), "--prompt", "ab", "--max-new-tokens", "4"])
    generate()
    printed = capsys.readouterr().out
    assert printed.startswith("ab") and len(printed.rstrip("\n")) > 2
