"""The float8 step of apply_layout (`train.float8`): torchao's float8 training on the blocks' Linear layers.

Each converted Linear casts its input, weight and output gradient to float8 (e4m3) with dynamic scales and runs its
three matmuls on the FP8 tensor cores (sm_89: Ada, e.g. RTX 4080 and L40; sm_90: Hopper), accumulating in higher
precision; weights, gradients and optimizer state stay as they were. Two recipes, torchao's:
  tensorwise  one scale per tensor: the fastest; under FSDP over two or more ranks the weights are all-gathered in
              float8 (half of bf16's bytes on the wire) with every weight's scale computed in one pass after the
              optimizer step; under tensor parallelism torchao's float8 styles cast each block's input once, before
              the sequence-parallel all-gather, which then moves float8
  rowwise     one scale per row: closer to bf16 on outliers, slower; communication stays in the compute dtype;
              compiled, inductor rounds its fused casts as eager kernels do (round_compiled_casts_as_eager)
What is converted (torchtitan's rule): Linear layers inside the blocks whose two dimensions are multiples of 16
(what the FP8 matmul needs), except the MoE router, whose logits decide the routing; the LM head and the
embeddings stay in the compute dtype, as do the experts' stacked weights (no Linear). Under `train.float8_layers=
auto` (the default) only those large enough for the FP8 matmul to beat bf16's, by torchao's per-recipe thresholds
(measured on an H100: below them the casts cost more than the faster matmul saves; GPT-2's 768-wide layers mostly
are); `all` converts every eligible one. The start summary names what stayed in the compute dtype, and why.

On a CPU the casts run in torchao's emulation mode (float8 rounding, fp32 matmuls): it proves the wiring and the
numerics of the casts, not the speed of the FP8 kernels. On a GPU below sm_89 float8 is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from llmtrain.errors import ConfigError
from llmtrain.optional import import_torchao

FP8_CAPABILITY = (8, 9)
MATMUL_MULTIPLE = 16
_UNCONVERTED_NAMES = ("router", "lm_head")


@dataclass(frozen=True)
class Float8:
    """How this rank runs `train.float8`: the recipe, emulated (CPU) or on FP8 tensor cores, whether FSDP
    all-gathers the weights in float8 and whether tensor parallelism takes torchao's float8 styles."""

    recipe: str  # tensorwise | rowwise
    layers: str  # auto (where the FP8 matmul pays) | all (every eligible layer): train.float8_layers
    emulate: bool
    fsdp_all_gather: bool
    tensor_parallel_styles: bool  # torchao's float8 styles for tensor parallelism

    @property
    def description(self) -> str:
        how = ["emulated on CPU: numerics only, no FP8 kernels" if self.emulate else "FP8 tensor cores"]
        if self.fsdp_all_gather:
            how.append("FSDP all-gathers in float8")
        if self.tensor_parallel_styles:
            how.append("float8 tensor-parallel styles")
        return f"float8 {self.recipe} ({', '.join(how)})"


def float8_on(
    recipe: str, layers: str, device: torch.device, sharded: bool, tensor_parallel: bool, sequence_parallel: bool
) -> Float8 | None:
    """`train.float8=recipe` over `layers` on `device` (None for `none`); ConfigError on a GPU without FP8 tensor
    cores.
    `sharded`: FSDP shards the weights over more than one rank (tensorwise then gathers them in float8).
    Tensorwise tensor parallelism takes torchao's float8 styles, except under sequence parallelism on a CPU: their
    float8 all-gather needs NCCL (gloo has no float8 collectives), so there each Float8Linear casts after torch's own
    all-gather."""
    if recipe == "none":
        return None
    if device.type == "cuda":
        check_fp8_tensor_cores(recipe, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    emulate = device.type != "cuda"
    tensorwise = recipe == "tensorwise"
    return Float8(
        recipe,
        layers,
        emulate=emulate,
        fsdp_all_gather=sharded and tensorwise,
        tensor_parallel_styles=tensor_parallel and tensorwise and not (emulate and sequence_parallel),
    )


def check_fp8_tensor_cores(recipe: str, device_name: str, capability: tuple[int, int]) -> None:
    """ConfigError (one line) when a GPU of this compute capability has no FP8 tensor cores."""
    if capability < FP8_CAPABILITY:
        raise ConfigError(
            f"train.float8={recipe} needs FP8 tensor cores (sm_89 or newer: RTX 40xx, L40, H100), but {device_name} "
            f"is sm_{capability[0]}{capability[1]}: set train.float8=none"
        )


BELOW_PAYING_SIZE = "below the sizes where the FP8 matmul pays (train.float8_layers=all converts them)"


def kept_because(module: nn.Linear, name: str, recipe: str, layers: str) -> str | None:
    """Why the Linear `name` stays in the compute dtype under float8's `recipe` over `layers` (train.float8_layers);
    None where it runs in float8."""
    parts = name.split(".")
    if "blocks" not in parts:
        return "outside the blocks"
    if parts[-1] in _UNCONVERTED_NAMES:
        return "the router: its logits decide the routing"
    if module.in_features % MATMUL_MULTIPLE or module.out_features % MATMUL_MULTIPLE:
        return f"a dimension not a multiple of {MATMUL_MULTIPLE}"
    if layers == "auto":
        pays = import_torchao("torchao.float8")._auto_filter_for_recipe(recipe, filter_fqns=[])
        if not pays(module, name):
            return BELOW_PAYING_SIZE
    return None


def apply_float8(model: nn.Module, float8: Float8) -> None:
    """Swap the Linear layers float8 converts for torchao's Float8Linear (on the meta device: no memory yet)."""
    torchao_float8 = import_torchao("torchao.float8")  # the run's first use of torchao
    config = replace(
        torchao_float8.Float8LinearConfig.from_recipe_name(float8.recipe),
        emulate=float8.emulate,
        enable_fsdp_float8_all_gather=float8.fsdp_all_gather,
    )

    def converts(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and kept_because(module, name, float8.recipe, float8.layers) is None

    torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=converts)


def float8_weight_share(model: nn.Module, recipe: str, layers: str) -> float:
    """The share of the values of the blocks' Linear weights that float8's `recipe` over `layers` converts (what
    FSDP then gathers in float8 under tensorwise); `model` may be on the meta device."""
    values = {True: 0, False: 0}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "blocks" in name.split("."):
            values[kept_because(module, name, recipe, layers) is None] += module.weight.numel()
    total = values[True] + values[False]
    return values[True] / total if total else 0.0


def round_compiled_casts_as_eager() -> None:
    """Inductor rounds the casts it fuses as eager kernels do. Compiled rowwise float8 (with activation
    checkpointing, whose recomputation fuses differently) can otherwise produce NaNs on the GPU (pytorch issue
    150859; torchtitan sets the same). Process-wide, as inductor's configuration is."""
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True


def float8_summary(float8: Float8, model: nn.Module) -> str:
    """What float8 does to `model` (this rank's part of it), for the start summary: the recipe, how it runs, which
    Linear layers it converted, and which it kept in the compute dtype and why (named by their last two parts,
    once each)."""
    from torchao.float8.float8_linear import Float8Linear

    converted: dict[str, None] = {}
    kept: dict[str, dict[str, None]] = {}
    for name, module in model.named_modules():
        short = ".".join(name.split(".")[-2:]) if "blocks" in name.split(".") else name
        if isinstance(module, Float8Linear):
            converted[short] = None
        elif isinstance(module, nn.Linear):
            why = kept_because(module, name, float8.recipe, float8.layers) or "not converted"
            kept.setdefault(why, {})[short] = None
    count = sum(isinstance(module, Float8Linear) for module in model.modules())
    on = f"on {count} Linear layers ({', '.join(converted)})" if count else "on no Linear layer: it changes nothing"
    why = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in kept.items())
    return f"{float8.description} {on}" + (f"; kept in the compute dtype: {why}" if why else "")


def float8_tensor_parallel_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with torchao's float8 styles where they apply (tensorwise): a column- or row-parallel Float8Linear
    gets its float8 style (the input all-gathered in float8), and a module whose input goes only to Float8Linear
    layers casts it once before the all-gather. Other entries stay as they are."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def converted(name: str) -> bool:
        return isinstance(model.get_submodule(name), Float8Linear)

    result: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        if isinstance(style, ColwiseParallel) and converted(name):
            style = Float8ColwiseParallel(**_layouts(style))
        elif isinstance(style, RowwiseParallel) and converted(name):
            style = Float8RowwiseParallel(**_layouts(style))
        elif type(style) is PrepareModuleInput and _feeds_only_float8(model.get_submodule(name), Float8Linear):
            style = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                use_local_output=style.use_local_output,
            )
        result[name] = style
    return result


def _layouts(style: Any) -> dict[str, Any]:
    """A plain column- or row-parallel style's constructor arguments."""
    layouts = dict(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0])
    return {**layouts, "use_local_output": style.use_local_output}


def _feeds_only_float8(module: nn.Module, float8_linear: type) -> bool:
    """Whether every Linear directly inside `module` (attention's q, k, v; the MLP's up, gate) is a Float8Linear:
    then its input can be cast once, before the all-gather."""
    linears = [child for child in module.children() if isinstance(child, nn.Linear)]
    return bool(linears) and all(isinstance(child, float8_linear) for child in linears)


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> Callable[[], None]:
    """With float8 all-gathers: after each optimizer step, every sharded weight's float8 scale in one pass (one
    all-reduce of the amaxes) instead of one per weight inside each all-gather. Returned: that pass, for weights
    set otherwise. A checkpoint loaded in place needs it: DCP builds the optimizer's state by running a step (of
    learning rate 0) whose hook computes the scales from the weights as built, which the load then replaces; the
    next all-gathers would quantise the loaded weights with those stale scales."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute() -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    optimizer.register_step_post_hook(lambda *_: precompute())
    return precompute
