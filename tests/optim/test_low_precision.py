"""Float8 training (`train.float8`, torchao) and 8-bit AdamW (`optim.state_bits=8`, torchao) on CPU.

What these prove: which layers float8 converts; the refusals; that torchao's emulated float8 (float8 rounding of
inputs, weights and output gradients, fp32 matmuls) runs through FSDP's float8 all-gather and the per-step scale
precompute, torchao's float8 tensor-parallel styles and plain tensor parallelism with sequence parallelism, and
follows the unsplit float8 model; that 8-bit AdamW follows the unsplit 8-bit run under FSDP and DDP and 32-bit
AdamW within a bound; and that a checkpoint of both resumes on another layout. What they do not prove: the speed
of the FP8 kernels or the float8 collectives of NCCL (gloo has none for tensor parallelism's all-gathers), which
only `llmtrain.tools.gpu_check` measures.

The 8-bit AdamW's step is compiled (9 s on this CPU); the tests run it eagerly (TORCHDYNAMO_DISABLE=1, read by
torch.compile at each call), but for the one that holds the compiled step to the eager one.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.layouts import FLOAT8_RTOL, LAYOUT_WORKER
from harness.processes import torchrun
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

# before llmtrain's imports, some of which import torchao
pytest.importorskip("torchao", reason="the fp8 extra (torchao): pip install -e '.[fp8]'")

from llmtrain.checkpoint.training import check_optimizer_matches
from llmtrain.config import OptimConfig, require_extra, validate
from llmtrain.errors import ConfigError
from llmtrain.model import build_model, cross_entropy_loss, meta_model, num_parameters
from llmtrain.optim import HostAdamW, adamw, adamw8bit, offload
from llmtrain.optim.state_bits import moment_bytes, portable_state
from llmtrain.optional import import_torchao
from llmtrain.parallel.float8 import (
    BELOW_PAYING_SIZE,
    Float8,
    apply_float8,
    check_fp8_tensor_cores,
    float8_summary,
    kept_because,
)
from llmtrain.tools import compose_config

EAGER = {"TORCHDYNAMO_DISABLE": "1"}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# float8 against the fp32 model: measured 6e-4 (tensorwise) and 9e-4 (rowwise) on the tiny model's first losses.
FLOAT8_VS_FP32_RTOL = 5e-3
# A resumed fsdp float8 run against one process, step 3: measured 4e-5 (loss) and 5e-6 (validation loss after the
# step's update) with 8-bit moments (and 0 and 1e-5 with offloaded ones, resumed by plain AdamW, when this test
# covered them too); float8 rounding makes it more than fp32's 1e-7.
RESUME_RTOL = 2e-4
# Requantising an 8-bit moment from its fp32 checkpoint: measured up to 0.8% of the tensor's largest value.
REQUANTIZED_SHARE = 0.02


@pytest.mark.slow  # a fresh interpreter: torchao's load noise comes once a process
def test_torchao_loads_without_a_word_on_the_console():
    """Importing torchao where its GPU kernels cannot load logs a warning per library (and torch one about an
    enum): llmtrain's import of it keeps them out of the user's console."""
    script = (
        "import logging; logging.basicConfig(); from llmtrain.optional import import_torchao; "
        "import_torchao('torchao.float8'); import_torchao('torchao.optim')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stderr[-2000:]


def _float8(recipe: str = "tensorwise", layers: str = "all") -> Float8:
    return Float8(recipe, layers, emulate=True, fsdp_all_gather=False, tensor_parallel_styles=False)


@pytest.mark.releases
def test_float8_converts_the_blocks_linears_but_not_the_head_router_or_odd_shapes():
    cfg = compose_config(["model=moe-tiny"])
    model = meta_model(cfg.model, 257)
    apply_float8(model, _float8())
    from torchao.float8.float8_linear import Float8Linear

    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert converted and all(name.startswith("blocks.") for name in converted)
    routers = {name for name in linears if name.endswith(".mlp.router")}
    assert routers and linears - converted == {"lm_head", *routers}
    # the FP8 matmul needs multiples of 16
    odd = kept_because(nn.Linear(24, 32), "blocks.0.mlp.fc_in", "tensorwise", "all")
    assert odd == "a dimension not a multiple of 16"
    summary = float8_summary(_float8(), model)
    assert "emulated" in summary and f"on {len(converted)} Linear layers" in summary and "lm_head" in summary


# torchao's thresholds (float8_linear_utils, from its H100 benchmarks), weight (N out, K in): tensorwise keeps
# K <= 4096 and N <= 1024; rowwise keeps N <= 2048, K <= 1024, and N <= 4096 with K <= 2048
@pytest.mark.releases  # torchao's filter on the torchao each release tier installs
@pytest.mark.parametrize(
    "model, recipe, converted",
    [
        ("gpt2", "tensorwise", ["mlp.fc_in"]),  # 3072 x 768; the 768 x 768 and 768 x 3072 layers stay
        ("gpt2", "rowwise", []),
        ("llama3.2-1b", "tensorwise", ["attn.q_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_gate", "mlp.fc_out"]),
        ("llama3.2-1b", "rowwise", ["mlp.fc_in", "mlp.fc_gate"]),
    ],
)
def test_auto_converts_only_the_layers_where_the_fp8_matmul_pays_and_says_which(model, recipe, converted):
    meta = meta_model(compose_config([f"model={model}"]).model, 50304)
    apply_float8(meta, _float8(recipe, layers="auto"))
    from torchao.float8.float8_linear import Float8Linear

    float8 = [name for name, module in meta.named_modules() if isinstance(module, Float8Linear)]
    names = {".".join(name.split(".")[-2:]) for name in float8}
    assert sorted(names) == sorted(converted)
    summary = float8_summary(_float8(recipe, layers="auto"), meta)
    assert "lm_head: outside the blocks" in summary
    if converted:
        assert f"({', '.join(converted)})" in summary and BELOW_PAYING_SIZE in summary
    else:
        assert "on no Linear layer: it changes nothing" in summary


@pytest.mark.releases
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_rounds_but_stays_near_fp32(recipe):
    torch.manual_seed(0)
    cfg = compose_config(["model=tiny"])
    model = build_model(cfg.model, 257, seed=0)
    converted = copy.deepcopy(model)
    apply_float8(converted, _float8(recipe))
    tokens = torch.randint(0, 257, (4, 65))
    losses = [cross_entropy_loss(m(tokens[:, :-1]), tokens[:, 1:]) for m in (model, converted)]
    losses[1].backward()
    assert losses[1].item() != losses[0].item()  # the casts did round
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=FLOAT8_VS_FP32_RTOL)
    weights = [m.weight for m in converted.modules() if isinstance(m, nn.Linear) and m is not converted.lm_head]
    assert all(w.grad is not None and torch.isfinite(w.grad).all() and w.grad.any() for w in weights)


def test_float8_is_refused_below_sm_89_and_a_missing_extra_is_named():
    check_fp8_tensor_cores("tensorwise", "NVIDIA GeForce RTX 4080", (8, 9))
    check_fp8_tensor_cores("rowwise", "NVIDIA H200", (9, 0))
    with pytest.raises(ConfigError) as refused:
        check_fp8_tensor_cores("tensorwise", "NVIDIA A100-SXM4-80GB", (8, 0))
    message = str(refused.value)
    assert "\n" not in message and "sm_80" in message and "train.float8=none" in message
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[fp8\]'"):
        require_extra("torchao_is_not_this", "train.float8=tensorwise", "fp8")
    for overrides, message in (
        (["optim=muon", "optim.state_bits=8"], "optim.state_bits=8 .* optim=muon"),
        (["optim=muon", "optim.offload=true"], "optim.offload=true .* optim=muon"),
        (["optim.state_bits=8", "optim.offload=true"], "optim.offload=true .* optim.state_bits=8"),
        (["parallel=fsdp", "parallel.cpu_offload=true", "optim.offload=true"], "set optim.offload=false"),
        (["parallel=zero1", "optim.state_bits=8"], "parallel=zero2 or fsdp"),
        (["parallel=zero1", "optim.offload=true"], "parallel=zero2 or fsdp"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            validate(compose_config(overrides))
        assert "\n" not in str(refused.value)


@pytest.mark.releases
def test_8bit_adamw_follows_32bit_and_its_state_survives_a_checkpoint(monkeypatch):
    """The same gradients into torch's AdamW and torchao's 8-bit AdamW: the weights stay within 2% of how far they
    moved over 30 steps; the 8-bit moments take a quarter of the bytes and come back from the portable (fp32)
    state they are checkpointed as within a code step, so that a resumed step is the uninterrupted one within 5%
    of an update."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    torch.manual_seed(0)
    cfg = compose_config(["optim.state_bits=8", "optim.weight_decay=0.0", "optim.lr=0.01"]).optim
    start = nn.Linear(128, 64)
    models = {bits: nn.Linear(128, 64) for bits in (32, 8)}
    for model in models.values():
        model.load_state_dict(start.state_dict())
    optimizers = {bits: adamw([{"params": list(models[bits].parameters())}], _bits(cfg, bits)) for bits in (32, 8)}
    for _ in range(30):
        gradient = torch.randn(64, 128)
        for bits, model in models.items():
            model.weight.grad, model.bias.grad = gradient.clone(), gradient[:, 0].clone()
            optimizers[bits].step()
    moved = (models[32].weight - start.weight).abs().mean()
    assert (models[8].weight - models[32].weight).abs().mean() < 0.02 * moved
    weight = models[8].weight.detach()
    assert moment_bytes(weight, 8) == pytest.approx(weight.numel() * (1 + 4 / 256))
    assert moment_bytes(weight, 8) < moment_bytes(weight, 32) / 3.9

    eight = optimizers[8]
    saved = portable_state(get_optimizer_state_dict(models[8], eight, options=FLAT))
    assert all(type(value) is torch.Tensor for key, value in saved.items() if key.endswith("exp_avg"))  # fp32
    assert all(not torch.is_tensor(value) for key, value in saved.items() if key.endswith(".lr"))
    copy = nn.Linear(128, 64)
    copy.load_state_dict(models[8].state_dict())
    resumed = adamw([{"params": list(copy.parameters())}], _bits(cfg, 8))
    set_optimizer_state_dict(copy, resumed, saved, options=FLAT)
    for key in ("exp_avg", "exp_avg_sq"):
        original, back = eight.state[models[8].weight][key], resumed.state[copy.weight][key]
        assert type(back) is type(original)
        # A block whose largest value has no exact code gets a new scale: its values move by about a code step.
        difference = (back.dequantize() - original.dequantize()).abs().max()
        assert difference <= REQUANTIZED_SHARE * original.dequantize().abs().max()
    gradient = torch.randn(64, 128)
    for model, optimizer in ((models[8], eight), (copy, resumed)):
        model.weight.grad, model.bias.grad = gradient.clone(), gradient[:, 0].clone()
        optimizer.step()
    assert torch.allclose(copy.weight, models[8].weight, rtol=0, atol=0.05 * cfg.lr)  # an update is about lr


def _eight_bit_pair() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Two copies of a model with tensors of both kinds (quantised moments: 4096 values or more in whole blocks;
    fp32 ones: the rest), one under llmtrain's 8-bit AdamW and one under torchao's."""
    cfg = compose_config(["optim.state_bits=8", "optim.lr=0.01"]).optim
    models = []
    for _ in range(2):
        torch.manual_seed(1)
        models.append(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 128), nn.Embedding(100, 64), nn.LayerNorm(64)))
    groups = [
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]
        for model in models
    ]
    torchao = import_torchao("torchao.optim").AdamW8bit(groups[1], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return models, [adamw(groups[0], cfg), torchao]


def _step_both(models, optimizers, steps: int, skip_at: int | None = None) -> None:
    """The same random gradients into both; at step `skip_at`, one weight of each gets none."""
    torch.manual_seed(0)
    for step in range(steps):
        gradients = [torch.randn_like(p) for p in models[0].parameters()]
        for model, optimizer in zip(models, optimizers):
            for param, gradient in zip(model.parameters(), gradients):
                param.grad = gradient.clone()
            if step == skip_at:
                model[1].weight.grad = None
            optimizer.step()


@pytest.mark.releases
def test_the_8bit_adamw_is_torchaos_to_the_bit_across_chunks(monkeypatch):
    """Eagerly, llmtrain's chunked 8-bit AdamW and torchao's per-tensor one give the same weights to the bit for
    every quantised tensor, over chunks of 8192 values that split tensors between them and through a step where one
    tensor has no gradient (skipped, as torch's AdamW skips it, then stepped with its own count); the fp32 moments
    of the small tensors take torch's fused AdamW: its order of operations moves them by under 1e-5 of an update."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(adamw8bit, "CHUNK", 8192)
    models, optimizers = _eight_bit_pair()
    assert [len(flat.windows) for flat in optimizers[0]._flat if flat] == [4]  # 24,832 values in 4 chunks
    _step_both(models, optimizers, 8, skip_at=3)
    for (name, mine), theirs in zip(models[0].named_parameters(), models[1].parameters()):
        if mine.numel() >= 4096:
            assert torch.equal(mine, theirs), name
        else:
            assert torch.allclose(mine, theirs, rtol=3e-7, atol=1e-7), name  # 1e-5 of an update
    skipped = optimizers[0].state[models[0][1].weight]["step"]
    assert skipped == 7 and optimizers[0].state[models[0][0].weight]["step"] == 8


@pytest.mark.slow  # inductor compiles C++ in a process of its own
@pytest.mark.releases
def test_the_compiled_8bit_step_compiles_once_for_every_chunk_and_tensor_shape(monkeypatch):
    """The step as a GPU runs it, compiled: one graph for the four chunks of three weight shapes (torchao's compiles
    one per shape and calls it per tensor), within 1e-6 of torchao's eager step over five steps (inductor fuses the
    update: its rounding differs in the last bits, and a moment on a code boundary may take the next code)."""
    monkeypatch.setattr(adamw8bit, "CHUNK", 8192)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    models, optimizers = _eight_bit_pair()
    with monkeypatch.context() as eager_torchao:
        eager_torchao.setenv("TORCHDYNAMO_DISABLE", "1")
        _step_both(models[1:], optimizers[1:], 5)
    _step_both(models[:1], optimizers[:1], 5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for mine, theirs in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


def _bits(cfg, bits: int) -> OptimConfig:
    return OptimConfig(
        **{**{name: getattr(cfg, name) for name in OptimConfig.__dataclass_fields__}, "state_bits": bits}
    )


# float8 on every eligible layer: the tiny model's are all below the sizes where `auto` converts one
COMMON = (
    "model=tiny train.seq_len=32 train.batch_size=16 train.micro_batch_size=2 optim.warmup_steps=1 "
    "train.float8_layers=all"
)
FLOAT8_8BIT = "train.float8=tensorwise optim.state_bits=8"
LAYOUTS = [
    # float8 all-gathers, their scale precompute and 8-bit moments on DTensor shards, checkpointed after step 2
    f"{FLOAT8_8BIT} parallel=fsdp checkpoint.every=2",
    f"{FLOAT8_8BIT} parallel=tp",  # torchao's float8 tensor-parallel styles
    f"{FLOAT8_8BIT} parallel=pp",  # each stage converts its own blocks
    # torch's styles around Float8Linear; AdamW on the host over tensor-parallel and FSDP DTensors, and plain tensors
    "train.float8=rowwise optim.offload=true parallel=tp parallel.sequence_parallel=true",
    "train.float8=rowwise optim.offload=true parallel=fsdp",
    "train.float8=rowwise optim.offload=true parallel=ddp",
]


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> tuple[dict, Path]:
    """The layouts' results, and where their run directories are."""
    out = tmp_path_factory.mktemp("low-precision")
    torchrun(2, str(LAYOUT_WORKER), str(out), COMMON, *LAYOUTS, timeout=900, env=EAGER)
    return json.loads((out / "results.json").read_text()), out


@pytest.mark.slow
def test_float8_8bit_and_offload_layouts_follow_their_unsplit_model(group):
    results, _ = group
    for layout in LAYOUTS:
        reference = results[" ".join(["single", *layout.split(" parallel=")[0].split()])]
        for key in ("losses", "norms", "val_losses"):
            assert results[layout][key] == pytest.approx(reference[key], rel=FLOAT8_RTOL), (layout, key)
        assert results[layout]["same_names"]


@pytest.mark.slow
def test_every_layout_holds_what_its_settings_ask_for(group):
    """What the layouts hold, summed over their ranks, which their losses cannot show (emulated float8 moves a loss
    by less than FLOAT8_RTOL; an offloaded AdamW on a CPU is AdamW to the bit):
    - float8: the Linear layers of the blocks converted, by name: those of the plain model, no more, no fewer;
    - 8-bit: torchao's AdamW, its moments quantised (at least the unsplit run's values: the pipeline's last stage
      holds the tied head's own copy), about a byte a value where fp32 takes 4;
    - offload: the host AdamW, its moments in host memory."""
    results, _ = group
    plain = build_model(compose_config([COMMON.split()[0]]).model, 257, seed=0)
    blocks_linears = sorted(
        name for name, module in plain.named_modules() if isinstance(module, nn.Linear) and name.startswith("blocks.")
    )
    for layout in LAYOUTS:
        held = results[layout]["holdings"]
        reference = results[" ".join(["single", *layout.split(" parallel=")[0].split()])]["holdings"]
        assert held["float8_layers"] == blocks_linears, layout
        if "optim.state_bits=8" in layout:
            assert held["optimizer"] == ["AdamW8bit"], layout
            assert held["quantised_values"] >= reference["quantised_values"] > 0.9 * 2 * num_parameters(plain)
            # 1 byte a value, an fp32 scale per 256 values and torchao's 1 KiB code map per tensor
            assert held["quantised_bytes"] < 1.1 * held["quantised_values"], layout
        else:
            assert held["optimizer"] == ["HostAdamW"] and held["quantised_moments"] == 0, layout
        assert held["moment_devices"] == ["cpu"]


@pytest.mark.slow
def test_an_fsdp_float8_8bit_checkpoint_resumes_in_one_process(group, train):
    """The fsdp layout's checkpoint of step 2 (float8 weights, 8-bit moments on two ranks' shards, written in fp32)
    resumed by one process: its step 3 (the loss of the weights it loaded, the validation loss after the update its
    requantised moments made) is an uninterrupted one-process run's within RESUME_RTOL. (Offload writes AdamW's own
    format: test_the_offloaded_adamw_is_torchs_to_the_bit_and_loads_in_place.)"""
    _, out = group
    checkpoint = out / "layout-0" / "checkpoints" / "step-00000002"
    run = [*COMMON.split(), *FLOAT8_8BIT.split(), "train.steps=3", "train.eval_every=2"]
    whole = train(*run, name="whole", env=EAGER)
    resumed = train(*run, f"checkpoint.resume={checkpoint}", name="resumed", env=EAGER)
    assert whole.returncode == 0 and resumed.returncode == 0, whole.stderr[-3000:] + resumed.stderr[-3000:]
    assert "resumed   from" in resumed.stdout + resumed.stderr
    step3 = [run.metrics[-1] for run in (whole, resumed)]
    assert step3[0]["step"] == step3[1]["step"] == 3
    assert step3[1]["loss"] == pytest.approx(step3[0]["loss"], rel=RESUME_RTOL)
    assert step3[1]["val_loss"] == pytest.approx(step3[0]["val_loss"], rel=RESUME_RTOL)


@pytest.mark.slow
def test_an_fsdp_float8_run_resumed_on_its_ranks_repeats_the_uninterrupted_run(train):
    """fsdp with float8 all-gathers on two ranks, checkpointed after step 2 and resumed there: step 3 is the
    uninterrupted run's, to the bit. The all-gathers quantise each weight with a scale computed after every optimizer
    step; a resume computes them from the weights it loaded (DCP builds the optimizer's state with a step whose hook
    saw the weights as built, and the first step after every resume quantised with those). A learning rate of 0.02
    moves the weights' largest values far enough from the built ones for stale scales to change the loss."""
    run = [*COMMON.split(), "train.float8=tensorwise", "parallel=fsdp", "optim.lr=0.02", "train.steps=3"]
    run += ["train.eval_every=3", "checkpoint.every=2"]
    whole = train(*run, nproc=2, name="whole", env=EAGER)
    assert whole.returncode == 0, whole.stderr[-3000:]
    checkpoint = whole.run_dir / "checkpoints" / "step-00000002"
    resumed = train(*run, f"checkpoint.resume={checkpoint}", nproc=2, name="resumed", env=EAGER)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "FSDP all-gathers in float8" in resumed.stdout + resumed.stderr  # the scales this test is about
    step3 = [run.metrics[-1] for run in (whole, resumed)]
    assert step3[0]["step"] == step3[1]["step"] == 3
    assert step3[1]["loss"] == step3[0]["loss"] and step3[1]["val_loss"] == step3[0]["val_loss"], step3


@pytest.mark.slow
def test_a_32bit_run_refuses_an_8bit_checkpoint_with_one_line(group):
    _, out = group
    with pytest.raises(ConfigError) as refused:
        check_optimizer_matches(str(out / "layout-0" / "checkpoints" / "step-00000002"), OptimConfig())
    assert "optim.state_bits=8" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.releases
def test_the_offloaded_adamw_is_torchs_to_the_bit_and_loads_in_place(monkeypatch):
    """optim.offload on a CPU: the host copy, torch's functional AdamW a slice of tensors at a time (here the weight,
    then the bias) and the copy back give exactly torch's AdamW; its state, written in torch's format, loads into
    the existing host tensors, and into torch's AdamW, and both continue to the bit."""
    monkeypatch.setattr(offload, "SLICE", 1000)
    torch.manual_seed(0)
    cfg = compose_config(["optim.offload=true", "optim.lr=0.01"]).optim
    start = nn.Linear(64, 32)
    models = [nn.Linear(64, 32) for _ in range(3)]
    for model in models:
        model.load_state_dict(start.state_dict())
    plain = torch.optim.AdamW(models[0].parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    offloaded = adamw([{"params": list(models[1].parameters()), "weight_decay": 0.1}], cfg)
    plain.param_groups[0]["weight_decay"] = 0.1
    assert isinstance(offloaded, HostAdamW)

    def step(pairs, gradient):
        for model, optimizer in pairs:
            model.weight.grad, model.bias.grad = gradient.clone(), gradient[:, 0].clone()
            optimizer.step()

    for _ in range(5):
        step([(models[0], plain), (models[1], offloaded)], torch.randn(32, 64))
    assert torch.equal(models[1].weight, models[0].weight) and torch.equal(models[1].bias, models[0].bias)
    models[2].load_state_dict(models[1].state_dict())
    resumed = adamw([{"params": list(models[2].parameters()), "weight_decay": 0.1}], cfg)
    saved = get_optimizer_state_dict(models[1], offloaded, options=FLAT)
    resumed._state_of(models[2].weight)  # the state exists before the load: the load copies into it
    kept = resumed.state[models[2].weight]["exp_avg"]
    set_optimizer_state_dict(models[2], resumed, saved, options=FLAT)
    assert resumed.state[models[2].weight]["exp_avg"] is kept
    # AdamW's own format: either loads the other's (copies, as a checkpoint's: torch's load keeps the tensors given)
    copies = {key: value.clone() if torch.is_tensor(value) else value for key, value in saved.items()}
    set_optimizer_state_dict(models[0], plain, copies, options=FLAT)
    step([(models[1], offloaded), (models[2], resumed), (models[0], plain)], torch.randn(32, 64))
    assert torch.equal(models[2].weight, models[1].weight) and torch.equal(models[0].weight, models[1].weight)
