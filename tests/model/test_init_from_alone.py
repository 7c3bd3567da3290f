"""`model.init_from=<dir>` with no `model=`: the model its config.json names (family and shape, as transformers'
AutoModelForCausalLM builds it), for every family llmtrain imports, at sizes no preset names; the run's own keys
kept, a shape key beside it held to the checkpoint's, and a preset beside it to its shape as before; the planner
and the dry run sizing that model."""

from __future__ import annotations

import pytest
import torch
from harness.hf_families import HF_FAMILIES, LOGIT_ATOL, VOCAB, saved_hf_model

from llmtrain.errors import ConfigError
from llmtrain.model import build_model
from llmtrain.model.hf_adopted import with_init_from_model
from llmtrain.tools import compose_config


def adopted(overrides: list[str]):
    return with_init_from_model(compose_config(overrides), overrides)


@pytest.mark.slow  # writes and reads a model directory per family
@pytest.mark.parametrize("model_type", list(HF_FAMILIES))
def test_init_from_alone_builds_the_checkpoints_model_with_its_logits(tmp_path, model_type):
    theirs = saved_hf_model(tmp_path, model_type)
    cfg = adopted([f"model.init_from={tmp_path}"])
    ours = build_model(cfg.model, VOCAB, seed=1).eval()
    assert cfg.model.name == tmp_path.name and cfg.model.vocab_size == VOCAB
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # writes and reads a model directory
def test_the_runs_own_keys_stay_and_a_shape_key_beside_init_from_must_agree(tmp_path):
    saved_hf_model(tmp_path, "llama")
    init = f"model.init_from={tmp_path}"
    model = adopted([init, "model.lora.rank=8", "model.n_layer=2", "model.max_seq_len=64", "model.dropout=0.1"]).model
    assert (model.lora.rank, model.n_layer, model.max_seq_len, model.dropout) == (8, 2, 64, 0.1)
    assert (model.d_model, model.n_kv_head, model.tie_embeddings, model.norm, model.mlp) == (
        64, 2, False, "rmsnorm", "swiglu"
    )  # fmt: skip
    refused = r"another shape: model\.n_layer=3 \(theirs: 2\), model\.d_ff=64 \(theirs: 96\)"
    with pytest.raises(ConfigError, match=refused):
        adopted([init, "model.n_layer=3", "model.d_ff=64"])


@pytest.mark.slow  # writes and reads a model directory
def test_a_preset_beside_init_from_is_held_to_the_checkpoints_shape(tmp_path):
    saved_hf_model(tmp_path, "qwen3")
    overrides = ["model=qwen3-tiny", f"model.init_from={tmp_path}"]
    cfg = adopted(overrides)
    assert cfg.model.name == "qwen3-tiny"
    with pytest.raises(ConfigError, match=r"model\.n_layer=4 \(theirs: 2\).*leave model= out"):
        build_model(cfg.model, VOCAB, seed=1)


@pytest.mark.slow  # writes and reads a model directory
def test_the_planner_and_the_dry_run_size_the_checkpoint_no_preset_names(tmp_path, capsys):
    import json

    from llmtrain.tools.dry_run import dry_run_config
    from llmtrain.tools.plan import main as plan

    theirs = saved_hf_model(tmp_path / "model", "qwen3_moe")
    init = f"model.init_from={tmp_path / 'model'}"
    plan([init, "hardware=rtx4080x4", "model.lora.rank=16", f"plan.out={tmp_path / 'plan.json'}"])
    printed = capsys.readouterr().out
    assert printed.startswith("model: ") and f"run: train.py {init} parallel=" in printed
    assert json.loads((tmp_path / "plan.json").read_text())["parameters"] == theirs.num_parameters()
    model = dry_run_config([init, "parallel=fsdp", "dry_run.world_size=4"]).model
    assert (model.n_layer, model.moe.num_experts, model.moe.d_ff, model.head_dim) == (2, 4, 32, 16)
