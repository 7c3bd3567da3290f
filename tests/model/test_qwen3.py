"""Qwen3 (dense): the presets' parameter counts and the tiny model's logits against transformers' Qwen3ForCausalLM,
its weights in both directions (model.init_from of a saved Qwen3, and the export map into one), and the refusals.
Its layouts' parity with one process runs in tests/parallel/test_parallel.py and tests/data/test_sft.py."""

from __future__ import annotations

import pytest
import torch

from llmtrain.errors import ConfigError
from llmtrain.model import build_model, meta_model, num_parameters
from llmtrain.model.hf import hf_format_of
from llmtrain.model.hf_llama import to_llama_state_dict
from llmtrain.model.hf_qwen3 import qwen3_hf_config
from llmtrain.tools import compose_config

LOGIT_ATOL = 1e-5  # fp32; measured 1e-6
VOCAB = 257


def _hf_qwen3(directory, **shape) -> None:
    """A random Qwen3ForCausalLM of qwen3-tiny's shape (an untied head, heads of 32 over a width of 128), saved."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)  # fmt: skip
    model = Qwen3ForCausalLM(Qwen3Config(**{**config, **shape}))
    with torch.no_grad():  # transformers starts the head norms at one: make them tell the heads apart
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)


QWEN3 = ["model=qwen3-tiny", "model.tie_embeddings=false"]


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"])
def test_qwen3_parameter_counts_equal_transformers(preset):
    from transformers import Qwen3ForCausalLM

    ours = meta_model(compose_config([f"model={preset}"]).model, VOCAB)
    with torch.device("meta"):
        reference = Qwen3ForCausalLM(qwen3_hf_config(ours.cfg, 0))
    assert num_parameters(ours) - ours.cfg.padding_parameters == reference.num_parameters()


@pytest.mark.slow  # writes and reads a model directory
def test_a_hugging_face_qwen3_initialises_our_model_with_its_logits(tmp_path):
    """Query and key norms before the rotation, heads of 32 over a width of 128, grouped-query attention, rotary
    base 1e6: our qwen3-tiny started from a saved Qwen3ForCausalLM computes its logits."""
    from transformers import Qwen3ForCausalLM

    _hf_qwen3(tmp_path)
    ours = build_model(compose_config([*QWEN3, f"model.init_from={tmp_path}"]).model, VOCAB, seed=1).eval()
    theirs = Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.parametrize("tied", [True, False])
def test_our_qwen3_exports_into_transformers_with_our_logits(tied):
    """The export's map and config: Qwen3ForCausalLM takes every tensor of our model (strictly: none left over,
    none missing) and computes our logits, tied head or not."""
    from transformers import Qwen3ForCausalLM

    cfg = compose_config(["model=qwen3-tiny", f"model.tie_embeddings={str(tied).lower()}"]).model
    ours = build_model(cfg, VOCAB, seed=3).eval()
    with torch.no_grad():  # head norms away from one, so that a norm loaded into the wrong place shows
        for name, param in ours.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    family = hf_format_of(ours.cfg)
    assert family.transformers_class == "Qwen3ForCausalLM"
    theirs = Qwen3ForCausalLM(family.hf_config(ours.cfg, 0)).eval()
    theirs.load_state_dict(to_llama_state_dict(ours), strict=True)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # writes and reads a model directory
def test_a_qwen3_of_another_head_width_is_refused_naming_the_key(tmp_path):
    _hf_qwen3(tmp_path, head_dim=16)
    cfg = compose_config([*QWEN3, f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model\.head_dim=32 \(theirs: 16\)"):
        build_model(cfg.model, VOCAB, seed=1)


def test_head_norms_with_what_qwen3_has_not_are_refused_in_one_line():
    cfg = meta_model(compose_config(["model=qwen3-tiny", "model.sliding_window=[8,0]"]).model, VOCAB).cfg
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM") as refused:
        hf_format_of(cfg)
    assert "\n" not in str(refused.value)


def test_lora_targets_take_hugging_faces_names():
    """`model.lora.targets` as a Qwen3 recipe names them (o_proj, gate_proj, up_proj, down_proj): the same
    projections as ours (out_proj, fc_gate, fc_in, fc_out), each adapted once even when named both ways."""
    targets = "[q_proj,o_proj,gate_proj,up_proj,down_proj,out_proj]"
    cfg = compose_config(["model=qwen3-tiny", "model.lora.rank=4", f"model.lora.targets={targets}"]).model
    model = meta_model(cfg, VOCAB)
    assert model.cfg.lora.targets == ("q_proj", "out_proj", "fc_gate", "fc_in", "fc_out")
    adapted = {name.split(".")[-2] for name, param in model.named_parameters() if param.requires_grad}
    assert adapted == {"q_proj", "out_proj", "fc_gate", "fc_in", "fc_out"}
