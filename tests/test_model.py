"""The GPT: shapes, causality, GPT-2 parameter counts, initialisation and weight tying."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from llmtrain.model import GPT, GPTConfig, cross_entropy_loss, num_parameters
from llmtrain.train.optim import build_adamw

TINY = GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, max_seq_len=16)


def _model(cfg: GPTConfig = TINY, seed: int = 0) -> GPT:
    model = GPT(cfg)
    model.init_weights(seed)
    return model


def test_forward_shapes():
    tokens = torch.randint(0, TINY.vocab_size, (3, 11))
    assert _model()(tokens).shape == (3, 11, TINY.vocab_size)


def test_a_future_token_never_changes_an_earlier_logit():
    model = _model().eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % TINY.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize(
    "n_layer, n_head, d_model, expected",
    [
        (12, 12, 768, 124_439_808),
        (24, 16, 1024, 354_823_168),
        (36, 20, 1280, 774_030_080),
        (48, 25, 1600, 1_557_611_200),
    ],
)
def test_gpt2_parameter_counts_on_the_meta_device(n_layer, n_head, d_model, expected):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257, n_layer=n_layer, n_head=n_head, d_model=d_model, max_seq_len=1024))
    assert num_parameters(model) == expected


def test_initialisation_is_seeded_and_scales_residual_projections():
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
    residual_std = a.blocks["0"].attn.out_proj.weight.std().item()
    assert residual_std == pytest.approx(0.02 / math.sqrt(2 * TINY.n_layer), rel=0.1)
    assert a.blocks["0"].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_tied_weights_stay_tied_after_an_optimizer_step():
    model = _model()
    optimizer = build_adamw(model, OmegaConf.create(dict(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)))
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))
    before = model.tok_emb.weight.detach().clone()
    cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    assert model.lm_head.weight is model.tok_emb.weight
    assert not torch.equal(model.tok_emb.weight, before)


def test_blocks_have_stable_names_for_stage_splits():
    names = [n for n, _ in _model().named_parameters()]
    assert "blocks.1.attn.q_proj.weight" in names and "tok_emb.weight" in names and "norm.weight" in names
    assert "lm_head.weight" not in names  # tied: reported once, as the embedding


def test_initial_loss_is_uniform_over_the_vocabulary():
    tokens = torch.randint(0, TINY.vocab_size, (4, 16))
    loss = cross_entropy_loss(_model()(tokens[:, :-1]), tokens[:, 1:])
    assert loss.item() == pytest.approx(math.log(TINY.vocab_size), rel=0.05)
