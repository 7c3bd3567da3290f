"""Gemma 3 (its text model): the presets' parameter counts and the tiny model's logits against transformers'
Gemma3ForCausalLM, over more positions than a sliding window holds, with both rotary bases and a linear stretch of
the global one; its weights in both directions (model.init_from of a saved Gemma 3, also from inside a multimodal
release's language model, and the export map into one), and the refusals."""

from __future__ import annotations

import pytest
import torch

from llmtrain.errors import ConfigError
from llmtrain.model import build_model, meta_model, num_parameters
from llmtrain.model.hf import hf_format_of
from llmtrain.model.hf_gemma3 import gemma3_hf_config, to_gemma3_state_dict
from llmtrain.tools import compose_config

LOGIT_ATOL = 1e-5  # fp32
VOCAB = 257
GEMMA3 = ["model=gemma3-tiny"]
# the global blocks' rotation stretched 8 times, as Gemma 3 4B's
LINEAR = ["model.rope_scaling.type=linear", "model.rope_scaling.factor=8"]


def _random_norms(model: torch.nn.Module, seed: int) -> None:
    """Every norm's weight away from zero (both sides start them there), so a norm loaded into the wrong place, or
    scaled by w rather than 1 + w, changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5, generator=generator)


def _hf_gemma3(directory, linear: bool = False, **shape):
    """A random Gemma3ForCausalLM of gemma3-tiny's shape, saved."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    cfg = meta_model(compose_config([*GEMMA3, *(LINEAR if linear else [])]).model, VOCAB).cfg
    config = gemma3_hf_config(cfg, 0)
    for key, value in shape.items():
        setattr(config, key, value)
    model = Gemma3ForCausalLM(config)
    _random_norms(model, 1)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("preset", ["gemma3-tiny", "gemma3-1b", "gemma3-4b"])
def test_gemma3_parameter_counts_equal_transformers(preset):
    from transformers import Gemma3ForCausalLM

    ours = meta_model(compose_config([f"model={preset}"]).model, VOCAB)
    with torch.device("meta"):
        reference = Gemma3ForCausalLM(gemma3_hf_config(ours.cfg, 0))
    assert num_parameters(ours) - ours.cfg.padding_parameters == reference.num_parameters()


@pytest.mark.slow  # writes and reads a model directory
@pytest.mark.parametrize("linear", [False, True], ids=["rope", "linear-stretched global rope"])
def test_a_hugging_face_gemma3_initialises_our_model_with_its_logits(tmp_path, linear):
    """Gemma's (1 + w) norms in fp32 around both branches and over each query and key head, GeGLU, the embedding
    times sqrt(d_model), three blocks attending to their last 16 keys with base 1e4 and a global one with base 1e6
    (linearly stretched, or not), over 48 positions: our gemma3-tiny started from a saved Gemma3ForCausalLM computes
    its logits."""
    theirs = _hf_gemma3(tmp_path, linear).eval()
    overrides = [*GEMMA3, *(LINEAR if linear else []), f"model.init_from={tmp_path}"]
    ours = build_model(compose_config(overrides).model, VOCAB, seed=1).eval()
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # writes and reads a model directory
def test_the_language_model_of_a_multimodal_gemma3_release_initialises_ours(tmp_path):
    """A multimodal release keeps the text model's tensors under `language_model` and its shape in `text_config`:
    import reads both."""
    import json

    from safetensors.torch import load_file, save_file

    theirs = _hf_gemma3(tmp_path).eval()
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({key.replace("model.", "model.language_model.", 1): t for key, t in tensors.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    text = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    ours = build_model(compose_config([*GEMMA3, f"model.init_from={tmp_path}"]).model, VOCAB, seed=1).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


def test_our_gemma3_exports_into_transformers_with_our_logits():
    """The export's map and config: Gemma3ForCausalLM takes every tensor of our model (strictly) and computes our
    logits, sliding windows and both rotary bases carried by its layer_types and rope_parameters."""
    from transformers import Gemma3ForCausalLM

    ours = build_model(compose_config([*GEMMA3, *LINEAR]).model, VOCAB, seed=3).eval()
    _random_norms(ours, 2)
    family = hf_format_of(ours.cfg)
    assert family.transformers_class == "Gemma3ForCausalLM"
    theirs = Gemma3ForCausalLM(family.hf_config(ours.cfg, 0)).eval()
    theirs.load_state_dict(to_gemma3_state_dict(ours), strict=True)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # writes and reads a model directory
def test_a_gemma3_of_another_window_is_refused_naming_the_key(tmp_path):
    _hf_gemma3(tmp_path, sliding_window=8)
    cfg = compose_config([*GEMMA3, f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model\.sliding_window=\(16, 16, 16, None\) \(theirs: \(8, 8, 8, None\)\)"):
        build_model(cfg.model, VOCAB, seed=1)


@pytest.mark.slow  # writes and reads a model directory
def test_a_gemma3_with_what_ours_does_not_model_is_refused_in_one_line(tmp_path):
    _hf_gemma3(tmp_path, final_logit_softcapping=30.0)
    cfg = compose_config([*GEMMA3, f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0") as refused:
        build_model(cfg.model, VOCAB, seed=1)
    assert "\n" not in str(refused.value)


def test_windows_outside_gemma3_have_no_hugging_face_class():
    """A Llama-family model whose blocks have different windows: LlamaForCausalLM attends over the whole context in
    every block and MistralForCausalLM gives every block one window, so neither holds it: refused in one line,
    before export writes anything."""
    cfg = meta_model(compose_config(["model=llama-tiny", "model.sliding_window=[8,0]"]).model, VOCAB).cfg
    with pytest.raises(
        ConfigError, match=r"MistralForCausalLM only as .* share one window .*sliding_window=\[8, 0\]"
    ) as refused:
        hf_format_of(cfg)
    assert "\n" not in str(refused.value)
