"""The GPT: shapes, causality, GPT-2 parameter counts, initialisation and weight tying."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F
from harness.paths import REPO
from harness.processes import python
from omegaconf import OmegaConf

from llmtrain.model import GPT, GPTConfig, cross_entropy_loss, num_parameters
from llmtrain.optim import build_optimizer

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
    options = dict(
        name="adamw", lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, state_bits=32, offload=False
    )
    optim = OmegaConf.create(options)
    optimizer = build_optimizer(model, optim)
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


def _llama_config(preset: str, vocab_size: int, *overrides: str):
    from transformers import LlamaConfig

    from llmtrain.model import rope_scaling
    from llmtrain.model.hf_llama import hf_rope_scaling
    from llmtrain.tools import compose_config

    m = compose_config([f"model={preset}", *overrides]).model
    theirs = LlamaConfig(
        vocab_size=m.vocab_size or vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
        num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.n_kv_head,
        tie_word_embeddings=m.tie_embeddings, max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta,
        rope_scaling=hf_rope_scaling(rope_scaling(m.rope_scaling)), rms_norm_eps=m.norm_eps, attention_bias=False,
        mlp_bias=False,
    )  # fmt: skip
    return m, theirs


@pytest.mark.parametrize("preset", ["llama-tiny", "smollm2-135m", "llama3.2-1b"])
def test_llama_parameter_counts_equal_transformers(preset):
    from transformers import LlamaForCausalLM

    from llmtrain.model import meta_model

    model_cfg, theirs = _llama_config(preset, 256)
    ours = meta_model(model_cfg, 256)
    with torch.device("meta"):
        reference = LlamaForCausalLM(theirs)
    assert num_parameters(ours) - ours.cfg.padding_parameters == reference.num_parameters()


# Llama 3's rope scaling with a pretraining context of 16 tokens, so that 48 positions reach every band of it
LLAMA3_SCALING = ["model.rope_scaling.type=llama3", "model.rope_scaling.original_max_seq_len=16"]


@pytest.mark.parametrize("overrides", [[], LLAMA3_SCALING], ids=["rope", "llama3-scaled rope"])
def test_llama_logits_equal_transformers_with_the_same_weights(overrides):
    """RMSNorm, rotary positions in transformers' half-split convention (plain, and with Llama 3's scaling),
    grouped-query attention and SwiGLU: our llama-tiny with a LlamaForCausalLM's weights (named by the export's
    map) computes its logits."""
    from transformers import LlamaForCausalLM

    from llmtrain.model import meta_model
    from llmtrain.model.hf_llama import hf_name
    from llmtrain.model.materialize import materialize

    model_cfg, theirs = _llama_config("llama-tiny", 256, *overrides)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(theirs).eval()
    ours = meta_model(model_cfg, 256)
    state = reference.state_dict()
    materialize(ours, torch.device("cpu"), lambda name, full: full.copy_(state[hf_name(name)]))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), reference(tokens).logits, atol=1e-5, rtol=1e-4)


def test_llama3_rope_frequencies_equal_transformers():
    """Meta's Llama 3.2 scaling (32x, bands at 1 and 4 turns over 8,192 tokens) at its head size 64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmtrain.model import meta_model
    from llmtrain.model.rope import frequencies

    model_cfg, theirs = _llama_config("llama3.2-1b", 256)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")
    cfg = meta_model(model_cfg, 256).cfg
    ours = frequencies(cfg.d_model // cfg.n_head, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert (ours < frequencies(64, cfg.rope_theta)).any()  # the scaling changed something


def test_a_checkpoint_of_the_other_family_is_refused_naming_the_keys(tmp_path):
    """check_model_matches against a GPT-2 checkpoint's meta.json: a llama run names each differing key in one line;
    a checkpoint written before the family keys existed reads them as GPT-2's defaults."""
    import dataclasses
    import json

    from llmtrain.checkpoint.training import check_model_matches
    from llmtrain.errors import ConfigError
    from llmtrain.model import meta_model
    from llmtrain.tools import compose_config

    gpt2 = dataclasses.asdict(meta_model(compose_config(["model=tiny"]).model, 257).cfg)
    older = {key: value for key, value in gpt2.items() if key not in ("norm", "position", "mlp", "n_kv_head")}
    (tmp_path / "meta.json").write_text(json.dumps({"model": older}))
    check_model_matches(str(tmp_path), meta_model(compose_config(["model=tiny"]).model, 257).cfg)
    llama = meta_model(compose_config(["model=llama-tiny", "model.d_ff=512"]).model, 257).cfg
    with pytest.raises(ConfigError) as error:
        check_model_matches(str(tmp_path), llama)
    message = str(error.value)
    assert "\n" not in message
    for key in (
        "model.norm=rmsnorm (checkpoint: layernorm)",
        "model.position=rope",
        "model.mlp=swiglu",
        "model.n_kv_head=4",
    ):
        assert key in message


def test_flops_count_every_matrix_once_and_leave_lookups_out():
    """6 x the matmul weights (SwiGLU's three matrices, GQA's narrower K and V included) + 12·L·d·s for attention;
    a position table and an untied input embedding are lookups, not matmuls."""
    from llmtrain.model import flops_per_token, meta_model
    from llmtrain.tools import compose_config

    for overrides, lookups in (
        (["model=tiny"], 256 * 128),
        (["model=llama-tiny", "model.tie_embeddings=false"], 320 * 128),
    ):
        model = meta_model(compose_config(overrides).model, 257)
        n = num_parameters(model)
        assert flops_per_token(model.cfg, n, 64) == 6 * (n - lookups) + 12 * 4 * 128 * 64


# Each MLP kind written out from its paper's definition: (input, up projection, gate projection or None) -> hidden.
MLP_DEFINITIONS = {
    "gelu": lambda up, gate: F.gelu(up, approximate="tanh"),
    "swiglu": lambda up, gate: F.silu(gate) * up,
    "geglu": lambda up, gate: F.gelu(gate, approximate="tanh") * up,
    "relu2": lambda up, gate: torch.relu(up) ** 2,
}


@pytest.mark.parametrize("kind", list(MLP_DEFINITIONS))
def test_every_mlp_kind_computes_its_definition_and_is_counted_by_its_matrices(kind):
    """A row of MLP_KINDS builds its matrices at its width rule, computes its definition, and the planner, the
    parameter count and the FLOP count (experts inactive per token included) read its matrices from the row."""
    from llmtrain.catalog import MLP_KINDS
    from llmtrain.model import flops_per_token
    from llmtrain.model.flops import inactive_expert_parameters
    from llmtrain.model.moe import MoEConfig
    from llmtrain.planner.shapes import whole_model_parameters

    assert set(MLP_DEFINITIONS) == set(MLP_KINDS)
    row = MLP_KINDS[kind]
    cfg = GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=96, max_seq_len=16, mlp=kind, bias=False)
    model = _model(cfg)
    mlp = model.blocks["0"].mlp
    assert (mlp.fc_gate is not None) == row.gated and mlp.fc_in.out_features == row.width(96)
    assert row.width(96) == (256 if row.gated else 384)  # 8/3 x 96 rounded up to 64; 4 x 96
    x = torch.randn(5, 96)
    gate = None if mlp.fc_gate is None else mlp.fc_gate(x)
    torch.testing.assert_close(mlp(x), mlp.fc_out(MLP_DEFINITIONS[kind](mlp.fc_in(x), gate)))
    assert whole_model_parameters(cfg) == num_parameters(model)
    experts = GPTConfig(**{**cfg.__dict__, "moe": MoEConfig(num_experts=4, top_k=1)})
    assert inactive_expert_parameters(experts) == 2 * 3 * row.matrices * 96 * row.width(96)
    matmuls = num_parameters(model) - 16 * 96  # the position table is a lookup
    assert flops_per_token(cfg, num_parameters(model), 16) == 6 * matmuls + 12 * 2 * 96 * 16


def test_padded_vocabulary_ids_get_minus_infinity_and_change_nothing():
    """A vocabulary padded to a multiple of 64 (257 -> 320 rows) masks the padding ids' logits with -inf, so the
    loss and the real ids' logits are those of the same model without padding."""
    from llmtrain.model import build_model
    from llmtrain.tools import compose_config

    padded = build_model(compose_config([]).model, 257, seed=0)
    unpadded_cfg = compose_config(["model.vocab_multiple=1"]).model
    unpadded = build_model(unpadded_cfg, 257, seed=0)
    state = {name: value[:257] if value.shape[:1] == (320,) else value for name, value in padded.state_dict().items()}
    unpadded.load_state_dict({name: state[name] for name in unpadded.state_dict()})
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, plain = padded(tokens[:, :-1]), unpadded(tokens[:, :-1])
    assert padded.cfg.padded_vocab_size == 320 and unpadded.cfg.padded_vocab_size == 257
    assert torch.isneginf(logits[..., 257:]).all()
    torch.testing.assert_close(logits[..., :257], plain)
    assert cross_entropy_loss(logits, tokens[:, 1:]).item() == pytest.approx(
        cross_entropy_loss(plain, tokens[:, 1:]).item(), rel=1e-6
    )


@pytest.mark.slow  # three processes' imports
def test_activation_checkpointing_keeps_fewer_activations():
    """Evidence that recomputation happens (a mode that silently did nothing would still match `single`):
    MemTracker's peak activations of one forward + backward (llmtrain.bench.activation_memory), measured 34.1 MiB
    without, 22.6 selective (matmul outputs kept), 5.5 full (block inputs only) for 4 x 256 tokens of tiny."""
    peaks = {}
    for mode in ("none", "selective", "full"):
        done = subprocess.run(
            [
                python(),
                "-m",
                "llmtrain.bench.activation_memory",
                f"train.activation_checkpointing={mode}",
                "train.seq_len=256",
                "train.micro_batch_size=4",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,  # fmt: skip
        )
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[mode] = json.loads(done.stdout.strip().splitlines()[-1])["act"]
    assert peaks["full"] < 0.3 * peaks["none"] and peaks["full"] < peaks["selective"] < 0.8 * peaks["none"], peaks


@pytest.mark.slow  # dynamo traces each block: ~2 s apiece
@pytest.mark.parametrize(
    "preset, extra, recompute, dtype",
    [
        ("tiny", ["model.dropout=0.1", "model.attention_dropout=0.1"], "full", torch.float32),
        ("llama-tiny", ["cp"], "selective", torch.float32),  # rotary, grouped-query heads, ring attention
        ("mixtral-tiny", [], "none", torch.bfloat16),  # experts as one grouped GEMM
    ],
)
def test_every_kind_of_block_compiles_as_one_graph(preset, extra, recompute, dtype, one_rank_group):
    """What layout.apply_compile compiles with fullgraph=True: dense blocks with dropout and either recomputation,
    context-parallel blocks (the ring is one operator) and, in bf16, mixture blocks: no graph break."""
    from torch.distributed.device_mesh import init_device_mesh

    from llmtrain.model import build_model
    from llmtrain.parallel.context import apply_context_parallel
    from llmtrain.tools import compose_config

    torch._dynamo.reset()
    overrides = [f"model={preset}", *(e for e in extra if e != "cp")]
    model = build_model(compose_config(overrides).model, 97, seed=0, recompute=recompute)
    if "cp" in extra:
        apply_context_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)))
    block = list(model.to(dtype).train().blocks.values())[-1]
    explanation = torch._dynamo.explain(block)(torch.randn(2, 16, model.cfg.d_model, dtype=dtype))
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize(
    "overrides, world_size, unit",
    [
        (["parallel=single"], 1, "model"),
        (["parallel=ddp"], 2, "model"),
        (["parallel=zero1", "model=llama-tiny", "train.activation_checkpointing=selective"], 2, "model"),
        (["parallel=fsdp"], 2, "blocks"),  # FSDP's units are the blocks
        (["parallel=tp"], 2, "blocks"),
        (["parallel=pp"], 2, "blocks"),
        (["parallel=single", "train.attention=document"], 1, "blocks"),  # its masks are built between the blocks
        (["parallel=single", "model.sliding_window=[8,0,0,0]"], 1, "blocks"),
        (["parallel=ddp", "model=moe-tiny"], 2, "blocks"),  # a mixture block may break its graph
    ],
)
def test_compile_takes_the_whole_model_where_nothing_splits_it(overrides, world_size, unit):
    """train.compile's graphs: the whole model or each block (compile_unit), and the loss a graph of its own
    wherever the logits are whole (all but tensor parallelism's vocabulary shards)."""
    from contextlib import nullcontext

    from llmtrain.model import meta_model, summed_cross_entropy
    from llmtrain.model.scoring import TokenMarks
    from llmtrain.parallel.layout import compile_scope, compile_unit
    from llmtrain.parallel.mesh import RankMesh
    from llmtrain.parallel.step_setup import StepSetup
    from llmtrain.parallel_plan import ParallelPlan
    from llmtrain.process.runtime import Runtime
    from llmtrain.tools import compose_config

    cfg = compose_config([*overrides, "train.compile=true"])
    plan = ParallelPlan.of(cfg.parallel, cfg.train, cfg.model, world_size)
    scope = compile_scope(plan, plan.spec.fsdp_shards(plan.degrees.dp * plan.degrees.cp))
    assert compile_unit(scope, meta_model(cfg.model, 97)) == unit
    runtime = Runtime(0, world_size, 0, torch.device("cpu"), "none")
    setup = StepSetup.of(plan, RankMesh(plan.degrees, None, None, None), runtime, nullcontext, TokenMarks(96))
    assert setup.compiles_loss is (plan.degrees.tp == 1)
    assert (setup.cross_entropy is summed_cross_entropy) is not setup.compiles_loss  # the eager function, or a graph


@pytest.mark.slow  # dynamo traces the whole model: 7 s each
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_dense_model_compiles_as_one_graph(preset):
    """What apply_compile makes one graph of where nothing splits the model: embeddings, every block and the head,
    with dropout and recomputation inside, without a break."""
    from llmtrain.model import build_model
    from llmtrain.tools import compose_config

    torch._dynamo.reset()
    cfg = compose_config([f"model={preset}", "model.dropout=0.1"])
    model = build_model(cfg.model, 97, seed=0, recompute="selective").train()
    explanation = torch._dynamo.explain(model)(torch.randint(0, 97, (2, 16)))
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_reaches_a_fused_kernel_in_every_precision(dtype):
    """Half precision hands grouped key/value heads to SDPA as they are (flash attention takes them); fp32 repeats
    them first (CUDA's memory-efficient kernel takes no grouped heads, and SDPA's fallback, the math kernel, holds
    t x t scores per head). Either way each query head attends over its own group's key/value head."""
    from torch.overrides import TorchFunctionMode

    from llmtrain.model.gpt import causal_attention

    q = torch.randn(2, 8, 16, 4, dtype=dtype)
    k, v = torch.randn(2, 2, 16, 4, dtype=dtype), torch.randn(2, 2, 16, 4, dtype=dtype)
    handed: list[tuple[int, bool]] = []  # SDPA's key heads and enable_gqa, per call

    class Handed(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                handed.append((args[1].shape[1], kwargs.get("enable_gqa", False)))
            return func(*args, **kwargs)

    with Handed():
        out = causal_attention(q, k, v)
    assert handed == ([(8, False)] if dtype == torch.float32 else [(2, True)])
    repeated = (z.repeat_interleave(4, dim=1) for z in (k, v))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, *repeated, is_causal=True))


def test_the_chunked_loss_is_the_whole_one_and_keeps_no_fp32_logits_for_backward(monkeypatch):
    """chunked_cross_entropy over bf16 logits of 4 x 24 positions, 7 positions a chunk (LOSS_CHUNK_VALUES lowered to
    7 rows of a 1,000-token vocabulary), some targets unscored: the same loss and logits gradient as the whole
    summed_cross_entropy (the chunks' sums added in another order: within 1e-6), with and without gradients; what
    it keeps for backward is the bf16 logits, where the whole loss keeps its fp32 log-probabilities."""
    from llmtrain.model import chunked_cross_entropy, losses, summed_cross_entropy
    from llmtrain.model.scoring import UNSCORED

    monkeypatch.setattr(losses, "LOSS_CHUNK_VALUES", 7 * 1000)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 24, 1000, generator=generator).bfloat16()
    targets = torch.randint(0, 1000, (4, 24), generator=generator)
    targets[:, ::5] = UNSCORED
    results = {}
    for name, loss_fn in (("whole", summed_cross_entropy), ("chunked", chunked_cross_entropy)):
        leaf = logits.clone().requires_grad_(True)
        saved: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = loss_fn(leaf, targets)
        loss.backward()
        with torch.no_grad():
            assert loss_fn(logits, targets).item() == pytest.approx(loss.item(), rel=1e-6)
        largest_fp32 = max((t.numel() for t in saved if t.dtype == torch.float32), default=0)
        results[name] = loss.item(), leaf.grad, largest_fp32
    (whole, whole_grad, whole_kept), (chunked, chunked_grad, chunked_kept) = results["whole"], results["chunked"]
    assert chunked == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(chunked_grad, whole_grad)
    assert whole_kept == logits.numel() and chunked_kept == 0
