"""Dropout: one mask for any split of the tensor, one compiled graph per block, the same mask when recomputed."""

from __future__ import annotations

import pytest
import torch

from llmtrain.model.dropout import Split, keep_mask
from llmtrain.model.gpt import Block
from llmtrain.model.gpt_config import GPTConfig

DROPPY = GPTConfig(vocab_size=97, n_layer=1, n_head=4, d_model=32, max_seq_len=16, dropout=0.2, attention_dropout=0.3)


@pytest.mark.parametrize("dim, parts", [(1, 2), (1, 4), (2, 4), (0, 3)])
def test_the_chunks_of_a_split_mask_are_the_unsplit_mask(dim, parts):
    whole_shape = torch.Size([3, 8, 12, 5])
    seed = torch.tensor(2024)
    whole = keep_mask(whole_shape, 0.25, seed, None, torch.device("cpu"))
    chunk_shape = list(whole_shape)
    chunk_shape[dim] //= parts
    chunks = [
        keep_mask(torch.Size(chunk_shape), 0.25, seed, Split(dim, rank, parts), torch.device("cpu"))
        for rank in range(parts)
    ]
    assert torch.equal(torch.cat(chunks, dim), whole)


def test_the_mask_keeps_1_minus_p_independently_of_neighbours_and_seeds():
    shape = torch.Size([64, 128, 128])
    first = keep_mask(shape, 0.1, torch.tensor(1), None, torch.device("cpu")).flatten().float()
    second = keep_mask(shape, 0.1, torch.tensor(2), None, torch.device("cpu")).flatten().float()
    assert first.mean().item() == pytest.approx(0.9, abs=2e-3)
    correlations = torch.corrcoef(torch.stack([first[:-1], first[1:], second[:-1]]))
    assert correlations[0, 1].abs() < 0.01 and correlations[0, 2].abs() < 0.01


def test_a_block_with_dropout_compiles_into_one_graph():
    explanation = torch._dynamo.explain(Block(DROPPY, 0).train())(torch.randn(2, 8, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize(
    "mode, compiled", [("full", False), ("selective", False), pytest.param("selective", True, marks=pytest.mark.slow)]
)
def test_a_recomputed_block_drops_what_its_forward_dropped(mode, compiled):
    """Recomputation (inside the compiled graph when compiled) draws the same seeds, so the same masks."""
    torch.manual_seed(0)
    block, x = Block(DROPPY, 0).train(), torch.randn(2, 8, 32, requires_grad=True)
    recomputing = Block(DROPPY, 0, recompute=mode).train()
    recomputing.load_state_dict(block.state_dict())

    def gradients(block: Block) -> list[torch.Tensor]:
        torch.manual_seed(7)
        (torch.compile(block) if compiled else block)(x).square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        x.grad = None
        block.zero_grad()
        return grads

    stored = gradients(block)
    # Compiled, the recomputed region is fused differently from the forward's, so results differ by float32
    # rounding: a few ulps of the largest gradient (1.19e-6 was seen, failing an absolute 1e-6). 1e-5 of the largest
    # gradient of all leaves room for that; another dropout mask moves a dropped element's gradient by its whole
    # size. Of all, not of each tensor: the key projection's bias has no true gradient (softmax ignores a shift),
    # so its gradient is that rounding alone (1.9e-7 was seen against a tolerance of 2.3e-12 of its own largest).
    tolerance = 1e-5 * max(float(kept.abs().max()) for kept in stored)
    for recomputed, kept in zip(gradients(recomputing), stored, strict=True):
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=tolerance)
    assert not torch.equal(stored[0], gradients_without_dropout(block, x))  # dropout did change the gradients


def gradients_without_dropout(block: Block, x: torch.Tensor) -> torch.Tensor:
    block.eval()
    block(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    block.zero_grad()
    return grad
