"""Optimizer groups, Muon against torch's, the learning-rate schedules, and the precision policy."""

import contextlib
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.optim._muon import _zeropower_via_newtonschulz

from llmtrain.catalog import DECAY_SHAPES
from llmtrain.model import GPT, GPTConfig, build_model, cross_entropy_loss
from llmtrain.optim import build_lr_schedule, build_optimizer, is_hidden_matrix, lr_factor, newton_schulz
from llmtrain.optim.muon import NS_COEFFICIENTS, NS_EPS
from llmtrain.parallel.precision import precision_policy
from llmtrain.tools import compose_config

OPTIM = OmegaConf.to_object(compose_config(["optim.warmup_steps=10", "optim.min_lr_ratio=0.1"])).optim
MUON = OmegaConf.to_object(compose_config(["optim=muon"])).optim


def schedule(name: str, **options) -> object:
    return OmegaConf.create({**OmegaConf.to_container(OmegaConf.structured(OPTIM)), "lr_schedule": name, **options})


def test_warmup_then_cosine_to_the_floor():
    factors = [lr_factor(s, 100, OPTIM) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1)
    assert factors[10 + 89 // 2] == pytest.approx(0.55, abs=0.02)  # halfway through the decay


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, OPTIM)
    schedule = build_lr_schedule(optimizer, 100, OPTIM)
    seen = []
    for _ in range(100):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen[0] == pytest.approx(1e-4) and max(seen) == pytest.approx(1e-3) and seen[-1] == pytest.approx(1e-4)


def test_decay_only_on_matrices():
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, d_model=8, max_seq_len=8))
    decay, no_decay = build_optimizer(model, OPTIM).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("shape", sorted(DECAY_SHAPES))
def test_wsd_warms_up_holds_the_peak_then_decays_to_the_floor(shape):
    wsd = schedule("wsd", decay_fraction=0.2, decay_shape=shape)
    factors = [lr_factor(s, 100, wsd) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9:80] == [1.0] * 71
    assert factors[80] < 1.0 and all(a >= b for a, b in zip(factors[80:], factors[81:]))
    assert factors[-1] == pytest.approx(0.1)
    assert [lr_factor(s, 100, schedule("constant")) for s in (0, 9, 50, 99)] == pytest.approx([0.1, 1, 1, 1])


def test_a_wsd_run_resumed_in_its_stable_phase_with_more_steps_follows_the_longer_plan():
    """Saved at step 50 of a 100-step plan (stable until 80), continued as a 200-step run: the optimizer and schedule
    state restore the step count and the rates follow the 200-step plan, decay at its end included."""
    wsd = schedule("wsd", decay_fraction=0.2)

    def built(steps: int):
        optimizer = build_optimizer(torch.nn.Linear(2, 2), wsd)
        return optimizer, build_lr_schedule(optimizer, steps, wsd)

    short, short_schedule = built(100)
    for _ in range(50):
        short.step()
        short_schedule.step()
    longer, longer_schedule = built(200)
    longer.load_state_dict(short.state_dict())
    longer_schedule.load_state_dict(short_schedule.state_dict())
    seen = []
    for _ in range(150):
        seen.append(longer.param_groups[0]["lr"])
        longer.step()
        longer_schedule.step()
    assert seen == pytest.approx([1e-3 * lr_factor(s, 200, wsd) for s in range(50, 200)])
    assert seen[109] == 1e-3 and seen[-1] == pytest.approx(1e-4)  # stable to step 159, then the decay


def test_newton_schulz_is_torchs_and_orthogonalises_each_matrix_of_a_batch():
    torch.manual_seed(0)
    for shape in ((64, 48), (48, 64)):
        matrix = torch.randn(shape)
        ours = newton_schulz(matrix, 5, torch.bfloat16)
        assert torch.equal(ours, _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, 5, NS_EPS).float())
    experts = torch.randn(3, 32, 16)
    batched = newton_schulz(experts, 5, torch.float32)
    assert torch.allclose(batched, torch.stack([newton_schulz(e, 5, torch.float32) for e in experts]), atol=1e-6)
    singular_values = torch.linalg.svdvals(batched)  # the quintic maps them into about [0.5, 1.5], not to 1
    assert singular_values.min() > 0.3 and singular_values.max() < 1.3


def test_muon_takes_the_blocks_matrices_and_leaves_the_rest_to_adamw():
    cfg = OmegaConf.to_object(compose_config(["model=moe-tiny"])).model
    model = build_model(cfg, 256, 0)
    matrices, decay, no_decay = build_optimizer(model, MUON).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert matrices["muon"] and not decay["muon"] and not no_decay["muon"]
    assert {names[id(p)] for p in decay["params"]} == {"tok_emb.weight", "pos_emb.weight"}
    assert all(p.ndim == 1 for p in no_decay["params"])
    muon_names = {names[id(p)] for p in matrices["params"]}
    assert {"blocks.1.mlp.experts.w_in", "blocks.1.mlp.router.weight", "blocks.0.attn.q_proj.weight"} <= muon_names
    assert all(is_hidden_matrix(names[id(p)], p) for p in matrices["params"])


@pytest.mark.releases
def test_muon_follows_torchs_muon_and_adamw_step_for_step():
    """One optimizer doing torch.optim.Muon's update (match_rms_adamw scaling, bf16 Newton-Schulz) on the matrices
    and torch.optim.AdamW's on the rest: the same losses as the two of torch's side by side."""

    def losses(ours: bool) -> list[float]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16))
        if ours:
            optimizers = [build_optimizer(model, MUON, torch.bfloat16)]
        else:
            named = list(model.named_parameters())
            matrices = [p for n, p in named if is_hidden_matrix(n, p)]
            rest = [p for n, p in named if not is_hidden_matrix(n, p)]
            optimizers = [
                torch.optim.Muon(matrices, lr=MUON.lr, weight_decay=MUON.weight_decay, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(
                    [
                        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": MUON.weight_decay},
                        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
                    ],
                    lr=MUON.lr,
                    betas=(MUON.beta1, MUON.beta2),
                    eps=MUON.eps,
                    fused=True,
                ),
            ]
        generator, seen = torch.Generator().manual_seed(1), []
        for _ in range(6):
            tokens = torch.randint(0, 64, (4, 17), generator=generator)
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            seen.append(loss.item())
        return seen

    ours, torchs = losses(True), losses(False)
    assert ours == pytest.approx(torchs, rel=1e-5) and not math.isclose(ours[0], ours[-1])


def test_one_precision_policy_fsdp_casts_where_it_applies_autocast_elsewhere():
    """bf16 under FSDP: its mixed precision alone (no autocast on top); bf16 elsewhere: autocast; fp32: neither."""
    cuda = torch.device("cuda", 0)
    context, described = precision_policy(cuda, bf16=True, fsdp_mixed_precision=True)
    assert context is contextlib.nullcontext and described.startswith("bf16 (FSDP mixed precision")
    context, described = precision_policy(torch.device("cpu"), bf16=True, fsdp_mixed_precision=False)
    assert isinstance(context(), torch.autocast) and described.startswith("bf16 autocast")
    assert precision_policy(torch.device("cpu"), bf16=False, fsdp_mixed_precision=True) == (
        contextlib.nullcontext,
        "fp32",
    )


def _on_claimed_cuda(model: torch.nn.Module) -> None:
    """Replace `model`'s parameters, in place, by fake tensors that claim a CUDA device (inside a FakeTensorMode),
    each with a gradient: where an optimizer creates its state is then visible on a host without a GPU, which a
    CPU run hides (the host's tensors are on the host's device)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                claimed = torch.nn.Parameter(torch.empty(param.shape, device="cuda"))
                claimed.grad = torch.ones(param.shape, device="cuda")
                module._parameters[name] = claimed


def _devices(optimizer: torch.optim.Optimizer) -> dict[str, set[torch.device]]:
    """Each parameter's device -> the devices of its optimizer state's tensors."""
    found: dict[str, set[torch.device]] = {}
    for param, state in optimizer.state.items():
        held = {value.device for value in state.values() if isinstance(value, torch.Tensor)}
        found.setdefault(str(param.device), set()).update(held)
    return found


@pytest.mark.releases
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_every_optimizers_state_lives_where_its_kernel_needs_it(name):
    """Parameters claiming CUDA (fake tensors): every state tensor of AdamW and of both Muon groups lies on its
    parameter's device, as the fused CUDA kernel demands (Muon's AdamW groups once kept a host step count, which
    crashed on the first H200 step). ZeRO-1's slices create theirs with the same `adamw_state`; fake CUDA tensors
    cannot be copied into (a CPU build has no CUDA device guard), so its flat buffers are not built here. Offload
    pins host memory, which needs CUDA itself, and keeps its state on the host by design; torchao's 8-bit AdamW
    reads a value in its step, which fake tensors cannot give (both ran on the H200 without a placement error)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    optim_cfg = OmegaConf.to_object(compose_config([f"optim={name}"])).optim
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, max_seq_len=8))
    with FakeTensorMode(allow_non_fake_inputs=True):
        _on_claimed_cuda(model)
        optimizer = build_optimizer(model, optim_cfg, device=torch.device("cuda"))
        optimizer.step()
        optimizer.step()
    assert _devices(optimizer) == {"cuda:0": {torch.device("cuda", 0)}}
    if name == "muon":
        assert {group["muon"] for group in optimizer.param_groups} == {True, False}
