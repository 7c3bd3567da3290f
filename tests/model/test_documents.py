"""Packed documents that never see each other (train.attention=document, llmtrain/model/documents.py): the
boundaries read from the end-of-text tokens, the property itself (a token after a boundary gets the logits it gets
when its document is fed alone, for both families, on every kernel path one process has), that the mask matters on
the corpus the layouts are tested on, the unscored prediction at end-of-text in one mean over the batch, sliding
windows (model.sliding_window), and generation. Every layout's parity with one process under the mask, and the
property through each layout's own forward (layout_worker.boundary_gap): tests/parallel/test_parallel.py and
tests/parallel/test_context_parallel.py (DOCUMENTS); the ring's blocks: test_context_parallel.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness.corpora import DOCUMENT_CORPUS
from harness.paths import REPO
from harness.processes import python
from harness.runs import LOSS_RTOL
from torch.nn.attention.flex_attention import create_block_mask

from llmtrain.data.packing import pack_windows, tokenize_documents
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.model import GPT, GPTConfig, cross_entropy_loss
from llmtrain.model.documents import (
    document_attention,
    document_starts,
    flex_document_attention,
    visible,
    whole_window_documents,
)
from llmtrain.model.scoring import TokenMarks
from llmtrain.process.runtime import Runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config

EOS = 0
ONE_PROCESS = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
GPT2_STYLE = GPTConfig(vocab_size=50, n_layer=2, n_head=4, d_model=32, max_seq_len=32)
LLAMA_STYLE = GPTConfig(
    vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=32, norm="rmsnorm",
    position="rope", mlp="swiglu", bias=False, tie_embeddings=False,
)  # fmt: skip


def _model(cfg: GPTConfig) -> GPT:
    model = GPT(cfg)
    model.init_weights(0)
    return model.eval()


def test_documents_start_at_the_window_and_after_each_end_of_text():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, 6, EOS]])
    assert document_starts(tokens, EOS).tolist() == [[0, 0, 0, 3, 3, 5, 6, 6], [0, 1, 1, 1, 1, 1, 1, 1]]
    starts = document_starts(tokens, EOS)
    index = torch.arange(8)
    seen = visible(starts, index, index)[0, 0]
    assert seen[4].tolist() == [False, False, False, True, True, False, False, False]  # the end-of-text token's own
    assert seen[7].tolist() == [False] * 6 + [True, True]
    assert whole_window_documents(starts).positions[0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]


@pytest.mark.releases
@pytest.mark.parametrize("cfg", [GPT2_STYLE, LLAMA_STYLE], ids=["learned positions", "rotary, grouped-query"])
def test_a_token_after_a_boundary_gets_the_logits_of_its_document_alone(cfg):
    """Three documents packed in one window: each one's logits under the document mask are those of the document
    fed by itself (same positions, same keys), within fp32 kernel rounding; under causal attention the later ones'
    are not (the feature off fails this test)."""
    model = _model(cfg)
    generator = torch.Generator().manual_seed(1)
    lengths = (7, 12, 9)
    documents = [torch.cat([torch.randint(1, cfg.vocab_size, (n - 1,), generator=generator), torch.tensor([EOS])])
                 for n in lengths]  # fmt: skip
    window = torch.cat(documents)[None]
    with torch.no_grad():
        masked = model(window, documents=document_starts(window, EOS))
        causal = model(window)
        alone = [model(document[None]) for document in documents]
    begin = 0
    for n, expected in zip(lengths, alone):
        torch.testing.assert_close(masked[:, begin : begin + n], expected, rtol=0, atol=2e-6)
        begin += n
    assert (causal[:, lengths[0] :] - masked[:, lengths[0] :]).abs().max() > 1e-2


def test_attention_dropouts_explicit_path_keeps_to_the_documents():
    """Training with attention dropout computes the scores itself (model/gpt.py); at p -> 0 it is the fused
    path: the same document mask."""
    cfg = GPTConfig(**{**GPT2_STYLE.__dict__, "attention_dropout": 1e-12})
    model = _model(cfg)
    window = torch.tensor([[3, 4, 5, EOS, 6, 7, 8, 9, EOS, 10, 11]])
    starts = document_starts(window, EOS)
    with torch.no_grad():
        fused = model(window, documents=starts)
        explicit = model.train()(window, documents=starts)
    torch.testing.assert_close(explicit, fused, rtol=0, atol=2e-6)


@pytest.mark.releases
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attentions_forward_matches_the_sdpa_path_on_cpu():
    """CUDA's kernel (FlexAttention under a block mask from the same starts), run here uncompiled (its forward runs
    on CPU, its backward does not), against the CPU path: multi-head and grouped-query."""
    generator = torch.Generator().manual_seed(0)
    b, t, d = 2, 64, 16
    starts = document_starts(torch.randint(6, (b, t), generator=generator), EOS)

    def same_document(batch, head, q_index, kv_index):
        return (kv_index >= starts[batch, q_index]) & (kv_index <= q_index)

    block_mask = create_block_mask(same_document, b, None, t, t, device="cpu")
    documents = whole_window_documents(starts)
    for kv_heads in (4, 2):
        q = torch.randn(b, 4, t, d, generator=generator)
        k, v = (torch.randn(b, kv_heads, t, d, generator=generator) for _ in range(2))
        torch.testing.assert_close(
            flex_document_attention(q, k, v, block_mask),
            document_attention(q, k, v, documents.masks[None]),
            rtol=0,
            atol=1e-5,
        )


def test_on_the_layouts_test_corpus_the_mask_moves_the_loss_far_beyond_their_tolerance():
    """The parity tests under the mask (DOCUMENTS in test_parallel.py / test_context_parallel.py) hold fp32 losses
    to LOSS_RTOL; on their corpus and windows a layout that ignored the mask would be off by more than 10 times that
    already at initialisation (measured: 2.5e-4 of the loss; the gradients differ more). bf16's bound (2^-8) would
    not see it: the fp32 layouts are the ones that prove the mask."""
    tokenizer = ByteTokenizer()
    texts = [json.loads(line)["text"] for line in DOCUMENT_CORPUS.read_text().splitlines()[:200]]
    windows = torch.from_numpy(np.stack(list(pack_windows(tokenize_documents(texts, tokenizer), 33))[:16]))
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, d_model=64, max_seq_len=32)
    model = _model(cfg)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        masked = cross_entropy_loss(model(inputs, documents=document_starts(inputs, tokenizer.eos_id)), targets)
        causal = cross_entropy_loss(model(inputs), targets)
    assert (document_starts(inputs, tokenizer.eos_id) > 0).float().mean() > 0.2  # a quarter follow a boundary
    assert abs(masked - causal) > 10 * LOSS_RTOL * causal


def test_generation_continues_the_prompts_last_document_alone():
    """A prompt that holds an earlier document and its end-of-text token: the greedy continuation is the one the
    whole prompt's forward pass with its packed documents kept apart gives, token by token (llmtrain.generate reads
    the prompt as packed documents are read in training)."""
    from llmtrain.generate import continuations
    from llmtrain.model.sampling import SamplingSettings

    model = _model(GPT2_STYLE)
    prompt = [7, 8, 9, 10, EOS, 11, 12, 13]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            context = torch.tensor([ids])
            ids.append(int(model(context, documents=document_starts(context, EOS))[0, -1].argmax()))
    greedy = SamplingSettings(6, temperature=0)
    assert continuations(model, [prompt], greedy, seed=0, eos_id=EOS) == [ids[len(prompt) :]]


def test_an_unscored_target_is_left_out_of_one_mean_over_the_whole_batch():
    """train.score_after_eos=false: the prediction made at each end-of-text token is not scored, and the loss is
    the mean over the scored targets of all micro-batches together (not a mean of micro-batch means, which would
    weigh a micro-batch with fewer scored targets more: layouts that cut the batch differently would disagree).
    With it on, every target counts."""
    config = compose_config(
        ["model=tiny", "train.device=cpu", "train.seq_len=16", "train.batch_size=2", "train.micro_batch_size=1"]
    )
    eos, vocab = 256, 257
    windows = torch.randint(0, vocab - 1, (2, 17), generator=torch.Generator().manual_seed(0))
    windows[0, [2, 5, 9, 11]] = eos  # four unscored targets in the first row, none in the second
    micro_batches = [(row[None, :-1], row[None, 1:]) for row in windows]
    inputs, targets = windows[:, :-1], windows[:, 1:]
    for scored_after_eos in (True, False):
        config.train.score_after_eos = scored_after_eos
        model = build_parallel_model(config, ONE_PROCESS, vocab, marks=TokenMarks(eos))
        with torch.no_grad():
            losses = F.cross_entropy(model.module(inputs).flatten(0, 1), targets.flatten(), reduction="none")
        kept = torch.ones_like(losses, dtype=torch.bool) if scored_after_eos else inputs.flatten() != eos
        torch.testing.assert_close(model.evaluate(micro_batches), losses[kept].mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("cfg", [GPT2_STYLE, LLAMA_STYLE], ids=["learned positions", "rotary, grouped-query"])
def test_sliding_windows_reach_exactly_as_far_as_their_blocks_stack(cfg):
    """model.sliding_window=[4, 3]: block 0 sees a query's last 4 keys, block 1 its last 3, so a token reaches the
    logits of positions at most 3 + 2 = 5 after it, and no further; a window of 0 is the whole context."""
    model = _model(dataclasses.replace(cfg, sliding_window=(4, 3)))
    assert [block.attn.window for block in model.blocks.values()] == [4, 3]
    tokens = torch.randint(1, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[0, 3] = (changed[0, 3] + 1) % cfg.vocab_size
    with torch.no_grad():
        moved = (model(changed) - model(tokens)).abs().amax(-1)[0]
    assert (moved[3:9] > 1e-4).all() and (moved[9:] == 0).all() and (moved[:3] == 0).all()
    whole = _model(dataclasses.replace(cfg, sliding_window=(0,)))
    with torch.no_grad():
        torch.testing.assert_close(whole(tokens), _model(cfg)(tokens), rtol=0, atol=2e-6)


def test_a_sliding_window_stays_within_its_document():
    """With documents, a window never reaches across a boundary: the second document's logits are those it gets
    alone under the same windows."""
    model = _model(dataclasses.replace(GPT2_STYLE, sliding_window=(3, 0)))
    first, second = torch.tensor([5, 6, 7, 8, EOS]), torch.tensor([9, 10, 11, 12, 13, 14])
    window = torch.cat([first, second])[None]
    with torch.no_grad():
        packed = model(window, documents=document_starts(window, EOS))
        torch.testing.assert_close(packed[:, 5:], model(second[None]), rtol=0, atol=2e-6)


@pytest.mark.slow  # a train.py run and an export: ~10 s
def test_a_windowed_run_trains_end_to_end_and_refuses_an_export_that_would_compute_another_model(train, tmp_path):
    run = train(f"data.path={DOCUMENT_CORPUS}", "data=local", "data.tokenizer.kind=byte", "train.attention=document",
                "train.score_after_eos=false", "model.sliding_window=[8,0]", "train.steps=3")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.metrics[-1]["loss"] < run.metrics[0]["loss"]
    done = subprocess.run(
        [python(), "-m", "llmtrain.export", str(run.run_dir), str(tmp_path / "exported")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and not (tmp_path / "exported").exists()
    assert "model.sliding_window=[8, 0]: GPT2LMHeadModel" in done.stderr.strip().splitlines()[-1]


@pytest.mark.releases
def test_selective_recomputation_keeps_flex_attentions_output():
    """On CUDA the document mask runs in FlexAttention, a higher-order operator (no overload packet): the selective
    policy saves it as it saves SDPA's kernels, rather than failing on it or replaying it in backward. (FlexAttention
    refuses gradients on CPU, so the policy is asked directly.)"""
    from torch.utils.checkpoint import CheckpointPolicy

    from llmtrain.model.recompute import _save_expensive

    assert _save_expensive(None, torch.ops.higher_order.flex_attention) == CheckpointPolicy.MUST_SAVE
    assert _save_expensive(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _save_expensive(None, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE
