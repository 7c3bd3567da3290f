"""docs/extending.md, followed: its blocks, read out of the page and installed (tests/workers/extending_worker.py), do
what the page says, and they are new files and catalog rows alone. The layout row makes the option file the page
shows, the tables and a plan, and the planner costs it by its fields; the family's row makes meta_model build its
class for its preset, the layouts cut it as itself, the planner sizes it from its own shapes, it learns, and its
checkpoint reloads as the family; Lion's steps are the
ones worked by hand, a run of `optim=lion` trains with it, the planner counts its one moment and parallel=zero1
refuses it. The slow test trains the layout and the family on two processes against their one-process runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from extending_worker import (
    blocks,
    edits,
    install_data_source,
    install_family,
    install_layout,
    install_objective,
    install_optimizer,
    install_reward,
    write_options,
)
from harness.corpora import DOCUMENT_CORPUS, write_preference_data, write_prompt_data
from harness.layouts import assert_matches_single, needs_torchao
from harness.paths import WORKERS
from harness.preference import assert_adapter_gradients_match, preference_run, refereed_step
from harness.processes import torchrun
from omegaconf import OmegaConf

from llmtrain import catalog
from llmtrain.checkpoint.manager import read_meta
from llmtrain.checkpoint.offline import find_checkpoint, load_checkpoint_model
from llmtrain.checkpoint.training import check_model_matches
from llmtrain.config import OptimConfig, ParallelConfig
from llmtrain.config.validation import validate_data, validate_flat_slices, validate_objective
from llmtrain.errors import ConfigError
from llmtrain.export import export
from llmtrain.model import GPT, GPTConfig, meta_model, model_group_of, trainable_parameters
from llmtrain.model.quantize import is_nf4
from llmtrain.optim.compute import Compute
from llmtrain.parallel.family import GPT_LAYOUT, family_layout
from llmtrain.parallel_plan import Degrees, ParallelPlan
from llmtrain.planner.candidates import Candidate, enumerate_candidates, for_optimizer
from llmtrain.planner.cost import layout_cost
from llmtrain.planner.inputs import configured_state_bytes, llmtrain_state_bytes, machine_for, workload_for
from llmtrain.planner.shapes import holding, whole_model_parameters
from llmtrain.process.runtime import Runtime
from llmtrain.run.build import build_training
from llmtrain.tools import compose_config
from llmtrain.tools.layout_doc import option_file, readme_table, state_table
from llmtrain.train.loop import Trainer

WORKER = WORKERS / "extending_worker.py"
ALONE = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
# A short run of the tiny models on the tests' short documents in byte tokens, at a rate that shows learning in a
# few steps; nothing saved, nothing logged to W&B.
RUN = [
    "data=local",
    f"data.path={DOCUMENT_CORPUS}",
    "data.tokenizer.kind=byte",
    "train.seq_len=64",
    "train.batch_size=8",
    "train.micro_batch_size=8",
    "train.eval_every=0",
    "train.save_model=false",
    "train.device=cpu",
    "optim.warmup_steps=0",
    "checkpoint.resume=none",
    "logging.wandb.mode=disabled",
]


@pytest.fixture
def options(tmp_path) -> str:
    """The override under which the page's option files compose."""
    return write_options(tmp_path / "options")


def _train(overrides: list[str], steps: int, run_dir: Path):
    """The trainer's losses over `steps` steps of a run of `overrides`, and what it trained."""
    config = compose_config([*RUN, f"train.steps={steps + 1}", *overrides])
    parts = build_training(OmegaConf.to_object(config), ALONE, str(run_dir))
    records: list[dict] = []
    try:
        trainer = Trainer(parts, records.append)
        parts.model.module.train()
        for _ in range(steps):
            trainer.advance()
    finally:
        parts.data.close()
    return [record["loss"] for record in records], parts


def test_the_guide_adds_new_files_and_catalog_rows_and_edits_nothing_else():
    """A layout, a family, an optimizer, an objective, a data source and a reward are each code of its own and rows
    of llmtrain/catalog/'s tables: the page edits no function, and every block it adds to an existing file is rows
    of one of those tables."""
    assert edits() == [
        "llmtrain/catalog/layouts.py LAYOUTS",
        "llmtrain/catalog/models.py MODEL_FAMILIES",
        "llmtrain/catalog/optimizers.py OPTIMIZERS",
        "llmtrain/catalog/objectives.py OBJECTIVES",
        "llmtrain/catalog/data_sources.py DATA_SOURCES",
        "llmtrain/catalog/objectives.py REWARDS",
    ]
    for marker in edits():
        assert isinstance(getattr(catalog, marker.split()[1]), dict)


def test_the_layout_row_makes_its_option_file_tables_plan_and_costs(monkeypatch):
    rows = install_layout(monkeypatch)
    assert list(rows) == ["hybrid_zero2"]
    row = rows["hybrid_zero2"]
    assert option_file("hybrid_zero2", row) == blocks()["conf/parallel/hybrid_zero2.yaml"] + "\n"
    assert any(line.startswith("| `hybrid_zero2` | the batch; gradients") for line in readme_table())
    assert any(line.startswith("| `hybrid_zero2` | Ψ/S (Ψ during the step) | Ψ/S | 2Ψ/S |") for line in state_table())
    cfg = compose_config(
        ["model=tiny", "model.vocab_size=256", "hardware=rtx4080x4", "train.seq_len=64", "train.micro_batch_size=2"]
    )
    parallel = ParallelConfig(layout="hybrid_zero2", dp_replicate=-1, dp_shard=2, reshard_after_forward=False)
    assert (
        ParallelPlan.of(parallel, cfg.train, cfg.model, 4).describe()
        == "hybrid_zero2 HSDP (dp_replicate 2 x dp_shard 2)"
    )
    # Weighed by the planner from its fields: on two nodes of 4 ranks, hsdp's degrees with zero2's kept parameters
    # (a candidate for the default plan.layouts=dp, as hsdp is): hsdp's costs with that one knob turned, more held and
    # less sent than hsdp's own.
    work = workload_for(cfg, 256, configured_state_bytes(cfg, bf16=True))
    machine = machine_for(cfg, 8, 4, True)
    found = {c.name: c for c in enumerate_candidates(8, 4, cfg.model, cfg.train, "dp")}
    assert found["hybrid_zero2"].degrees == found["hsdp"].degrees == Degrees(dp_replicate=2, dp_shard=4)
    kept, hsdp = layout_cost(found["hybrid_zero2"], work, machine), layout_cost(found["hsdp"], work, machine)
    turned = layout_cost(dataclasses.replace(found["hsdp"], reshard_after_forward=False), work, machine)
    assert kept.heaviest == turned.heaviest and [dict(t.bytes) for t in kept.traffic] == [
        dict(t.bytes) for t in turned.traffic
    ]
    assert kept.heaviest.gathered > hsdp.heaviest.gathered
    assert kept.traffic[0].bytes["all_gather"] < hsdp.traffic[0].bytes["all_gather"]


def test_the_family_is_built_for_its_preset_cut_as_itself_and_learns(monkeypatch, options, tmp_path):
    """Its row alone makes meta_model build it; GPT's layout lays it out (the row names it), and the pipeline parts
    and stage views that layout makes are parallel-block models too."""
    parallel_block = install_family(monkeypatch)
    cfg = compose_config([options, "model=tiny-parallel"]).model
    assert cfg.family == "parallel_block"
    model = meta_model(cfg, 256)
    assert type(model) is parallel_block.ParallelBlockGPT
    assert all(type(block) is parallel_block.ParallelBlock for block in model.blocks.values())
    layout = family_layout(model)
    assert layout is GPT_LAYOUT
    part = layout.pipeline_part(model, [2, 3], False, True)
    assert type(part) is parallel_block.ParallelBlockGPT and list(part.blocks) == ["2", "3"] and part.tok_emb is None
    assert all(type(block) is parallel_block.ParallelBlock for block in part.blocks.values())
    view = layout.stage_view(part, [3], False, True)
    assert type(view) is parallel_block.ParallelBlockGPT and view.blocks["3"] is part.blocks["3"]
    assert type(meta_model(compose_config([options, "model=tiny"]).model, 256)) is GPT
    losses, parts = _train([options, "model=tiny-parallel", "optim.lr=3e-3"], 6, tmp_path)
    assert type(parts.model.module) is parallel_block.ParallelBlockGPT
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("adapted", ["", "lora", pytest.param("nf4", marks=needs_torchao)])
def test_the_planner_sizes_the_family_from_its_own_shapes(monkeypatch, options, adapted):
    """The row's shapes count what the built model holds: one norm a block fewer than GPT's, and with adapters
    (and an NF4 base, which the finished model quantizes whatever class built its modules) the frozen, quantized
    and trainable elements the model has."""
    install_family(monkeypatch)
    lora = ["model.lora.rank=4", "model.lora.targets=[q_proj,fc_in,fc_out]", "model.bias=false"] if adapted else []
    nf4 = ["model.quantize_base=nf4", "model.d_model=256", "model.n_head=4"] if adapted == "nf4" else []
    for family in ("parallel_block", "gpt"):
        cfg = compose_config([options, "model=tiny", f"model.family={family}", *lora, *nf4]).model
        model = meta_model(cfg, 256)
        held = holding(model.cfg)
        quantized = sum(p.numel() for p in model.parameters() if is_nf4(p))
        assert (held.trainable, held.quantized) == (trainable_parameters(model), quantized), family
        assert held.frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad), family
        assert bool(quantized) == (adapted == "nf4")
    gpt_cfg = dataclasses.replace(model.cfg, lora=dataclasses.replace(model.cfg.lora, rank=0), quantize_base="none")
    parallel_cfg = dataclasses.replace(gpt_cfg, family="parallel_block")
    norms = gpt_cfg.n_layer * gpt_cfg.d_model * (1 + int(gpt_cfg.bias))
    assert whole_model_parameters(gpt_cfg) - whole_model_parameters(parallel_cfg) == norms


def test_a_checkpoint_of_the_family_reloads_as_the_family(monkeypatch, options, tmp_path):
    """The checkpoint records the family beside the shape: the offline load (export's and generate's) rebuilds a
    ParallelBlockGPT with the trained model's logits, evaluate's model group builds one, a resume as another family
    is refused naming model.family, the Hugging Face export refuses it in one line (its row names no formats), and
    the config of a checkpoint written before the key (no family recorded) reads as the GPT's."""
    parallel_block = install_family(monkeypatch)
    _, parts = _train([options, "model=tiny-parallel", "optim.lr=3e-3"], 2, tmp_path)
    parts.checkpoints.save(2)
    parts.checkpoints.finish()
    checkpoint = find_checkpoint(str(tmp_path))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loaded = load_checkpoint_model(checkpoint)
    assert type(loaded) is parallel_block.ParallelBlockGPT
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), parts.model.module.eval()(ids), rtol=0, atol=1e-6)
    saved = GPTConfig.from_dict(read_meta(checkpoint)["model"])
    assert saved == loaded.cfg and saved.family == "parallel_block"
    group = model_group_of(saved, OmegaConf.to_object(compose_config([options, "model=tiny"])).model)
    assert type(meta_model(group, saved.vocab_size)) is parallel_block.ParallelBlockGPT
    with pytest.raises(ConfigError, match=r"model\.family=gpt \(checkpoint: parallel_block\)"):
        check_model_matches(checkpoint, dataclasses.replace(saved, family="gpt"))
    with pytest.raises(ConfigError, match=r"^model\.family=parallel_block has no Hugging Face class") as refused:
        export(checkpoint, str(tmp_path / "exported"))
    assert "\n" not in str(refused.value) and not (tmp_path / "exported").exists()
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    del meta["model"]["family"]
    assert GPTConfig.from_dict(meta["model"]).family == "gpt"


def test_lions_steps_are_the_ones_worked_by_hand(monkeypatch):
    """Two steps on three weights (lr 0.1, weight decay 0.5, beta1 0.9, beta2 0.99), worked out on paper. Step 1:
    the momentum is 0, so the update is sign(g₁) = (1, -1, 0); w = w(1 - 0.05) - 0.1 update = (0.85, -1.8, 0.475);
    the momentum becomes 0.01 g₁ = (0.003, -0.001, 0). Step 2: 0.9 m + 0.1 g₂ = (0.0007, -0.0509, 0.02): the first
    weight's momentum outvotes its gradient (-0.02); w = (0.8075 - 0.1, -1.71 + 0.1, 0.45125 - 0.1); the momentum
    0.99 m + 0.01 g₂."""
    lion = install_optimizer(monkeypatch)
    weights = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    optim_cfg = OptimConfig(lr=0.1, weight_decay=0.5, beta1=0.9, beta2=0.99)
    optimizer = lion.Lion([{"params": [weights]}], optim_cfg, Compute())
    for gradient in ([0.3, -0.1, 0.0], [-0.02, -0.5, 0.2]):
        weights.grad = torch.tensor(gradient)
        optimizer.step()
    assert weights.tolist() == pytest.approx([0.7075, -1.61, 0.35125], rel=1e-6)
    assert optimizer.state[weights]["momentum"].tolist() == pytest.approx([0.00277, -0.00599, 0.002], rel=1e-5)


def test_optim_lion_trains_with_lion(monkeypatch, options, tmp_path):
    lion = install_optimizer(monkeypatch)
    losses, parts = _train([options, "optim=lion", "optim.lr=1e-3"], 6, tmp_path)
    assert type(parts.model.optimizer) is lion.Lion
    assert losses[-1] < losses[0] - 0.5, losses


def test_lions_row_sizes_its_state_and_zero1_refuses_it(monkeypatch, options):
    """The planner counts the row's one fp32 moment a parameter (AdamW's two: 4 bytes fewer everywhere); ZeRO-1,
    for which the row names no form over flat slices, refuses it in one line naming optim.name, and parallel=auto
    leaves zero1 out of its candidates."""
    install_optimizer(monkeypatch)
    cfg, adamw = compose_config([options, "optim=lion"]), compose_config([options])
    sizes, adamw_sizes = llmtrain_state_bytes(cfg, bf16=False), llmtrain_state_bytes(adamw, bf16=False)
    assert sizes.optimizer == sizes.matrix_optimizer == adamw_sizes.optimizer - 4
    with pytest.raises(ConfigError, match=r"^optim\.name=lion has no form over parallel=zero1's") as refused:
        validate_flat_slices(cfg.optim, "zero1")
    assert "\n" not in str(refused.value) and "parallel=zero2 or fsdp" in str(refused.value)
    found = enumerate_candidates(4, 4, cfg.model, cfg.train, "dp")
    assert "zero1" in {c.name for c in for_optimizer(found, adamw.optim)}
    assert "zero1" not in {c.name for c in for_optimizer(found, cfg.optim)}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("pairs"))


def test_an_ipo_step_has_the_referees_loss_and_gradients(monkeypatch, pairs, tmp_path):
    """train.objective=ipo builds the page's objective; one step on adapters moved off zero: its loss is IPO's,
    (h - 1/(2β))² averaged over the pairs with h the log-likelihood-ratio margin, recomputed from the definition (a
    copy of the model for the policy, another with its adapters zeroed for the reference), and the adapters'
    gradients of the weighted cross-entropy it trains on are autograd's of that loss."""
    ipo = install_objective(monkeypatch)
    beta = 0.5
    config = compose_config([*preference_run(*pairs), "train.objective=ipo", f"data.beta={beta}", "train.eval_every=0"])
    parts = build_training(OmegaConf.to_object(config), ALONE, str(tmp_path / "run"))
    try:
        assert type(parts.objective) is ipo.IdentityPreference
        step = refereed_step(parts)
    finally:
        parts.data.close()
    margins = step.log_ratios[:, 0] - step.log_ratios[:, 1]
    loss = ((margins - 1 / (2 * beta)) ** 2).mean()
    loss.backward()
    # h is a difference of two fp32 sums of about -200 (a unit in the last place 1.5e-5 each), and the loss moves by
    # 2 |h - 1/(2β)| (about 1.5 here) per unit of h
    assert step.prepared.loss is not None and step.prepared.loss.item() == pytest.approx(loss.item(), abs=1e-4)
    assert_adapter_gradients_match(parts.model.module, step.referee)


def test_ipos_row_refuses_data_without_pairs_and_is_planned_with_its_forwards(monkeypatch, pairs, options):
    """The row's `pairs` refuses it on data without pairs in one line naming train.objective, and its
    `forwards_alone` adds two forward passes (a third of a step's compute each) to the planner's step."""
    install_objective(monkeypatch)
    with pytest.raises(ConfigError, match=r"^train\.objective=ipo with data=stdlib: it needs data=preference;"):
        validate_objective(compose_config([options, "train.objective=ipo"]))

    def compute_seconds(*overrides: str) -> float:
        cfg = compose_config([*preference_run(*pairs), "hardware=rtx4080x4", *overrides])
        work = workload_for(cfg, 514, llmtrain_state_bytes(cfg, True))
        return layout_cost(Candidate("single", Degrees()), work, machine_for(cfg, 1, 1, True)).compute_s

    assert compute_seconds("train.objective=ipo") == pytest.approx(compute_seconds("data=sft") * 5 / 3)


# The guide's layout as it runs on one machine (dp_shard: its 2 ranks), and its family under the two layouts that
# read the family's row: tensor parallelism (the plan) and a pipeline (its parts).
TWO_RANKS = [
    "parallel=hybrid_zero2",
    "model=tiny-parallel parallel=tp parallel.sequence_parallel=true train.micro_batch_size=8",
    "model=tiny-parallel parallel=pp parallel.pp_schedule=gpipe parallel.microbatches=4",
]


@pytest.mark.slow
def test_the_guides_layout_and_family_match_single_on_two_ranks(tmp_path_factory):
    options = write_options(tmp_path_factory.mktemp("options"))
    common = f"{options} model=tiny train.seq_len=32 train.batch_size=16 train.micro_batch_size=2 optim.warmup_steps=1"
    out = tmp_path_factory.mktemp("extending")
    torchrun(2, str(WORKER), str(out), common, *TWO_RANKS, timeout=600)
    results = json.loads((out / "results.json").read_text())
    for layout in TWO_RANKS:
        assert_matches_single(results, layout)


@pytest.mark.slow
def test_the_guides_objective_matches_single_on_two_ranks(tmp_path_factory, pairs):
    """IPO's pairs split over two FSDP ranks against one process; its first loss is 1/(4β²): the policy starts as
    its reference."""
    run = " ".join(preference_run(*pairs)).replace("train.device=cpu logging.wandb.mode=disabled", "")
    common = f"{run} train.objective=ipo data.beta=0.5 optim.warmup_steps=1 optim.lr=3e-3"
    out = tmp_path_factory.mktemp("objective")
    torchrun(2, str(WORKER), str(out), common, "parallel=fsdp", timeout=600)
    results = json.loads((out / "results.json").read_text())
    assert_matches_single(results, "parallel=fsdp")
    assert results["parallel=fsdp"]["losses"][0] == pytest.approx(1.0)


# -- the data source -------------------------------------------------------------------------------------------------
NAMES = [f"{first}{second}" for first in ("ka", "mi", "to", "re", "su", "no") for second in ("ra", "ko", "li", "den")]


@pytest.mark.slow  # seconds: a streamed source built and 8 steps trained
def test_the_data_sources_lines_are_documents_and_it_trains(monkeypatch, options, tmp_path):
    """Its row alone makes data=lines read: each line a document ended by end-of-text (data=local would read the
    file as one), the held-out lines apart, the row's key required in one line; a few steps learn."""
    install_data_source(monkeypatch)
    names = tmp_path / "names.txt"
    names.write_text("\n".join(NAMES * 10) + "\n")
    run = [options, "data=lines", f"data.path={names}", "data.tokenizer.kind=byte", "train.seq_len=32"]
    run += ["train.batch_size=8", "train.micro_batch_size=8", "train.eval_every=0", "train.save_model=false"]
    run += ["train.device=cpu", "optim.warmup_steps=0", "optim.lr=3e-3", "checkpoint.resume=none"]
    run += ["logging.wandb.mode=disabled", "model=tiny"]
    config = compose_config(run)
    with pytest.raises(ConfigError, match=r"^data\.path is not set: data=lines needs data\.path=<file, folder or glob"):
        validate_data(compose_config([options, "data=lines"]).data)
    parts = build_training(OmegaConf.to_object(config), ALONE, str(tmp_path / "run"))
    records: list[dict] = []
    try:
        rows = parts.data.train.next()
        eos = parts.data.tokenizer.eos_id
        for row in rows.tolist():
            pieces = bytes(t if t != eos else 10 for t in row).decode().split("\n")
            assert set(pieces[1:-1]) <= set(NAMES) and len(pieces) > 3  # whole names between the ends
        trainer = Trainer(parts, records.append)
        for _ in range(8):
            trainer.advance()
    finally:
        parts.data.close()
    losses = [record["loss"] for record in records]
    assert losses[-1] < losses[0] - 0.5, losses


# -- the reward ------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # seconds: a GRPO job built and a step taken
def test_the_rewards_scores_are_the_ones_graded_by_hand_and_grpo_trains_with_it(monkeypatch, tmp_path):
    """answer_in_text finds the answer inside a sentence, an alias of a list, a punctuated and articled answer; a
    wrong one scores 0 and a record without an answer is left unscored; data.reward=[answer_in_text] names it in
    GRPO's record."""
    module = install_reward(monkeypatch)
    scores = module.answer_in_text(
        ["q"] * 5,
        ["It was Paris, of course.", "I think the Eiffel Tower.", "Mount Everest", "nope", "anything"],
        ["paris", ["Tour Eiffel", "eiffel tower"], "The Everest!", "42", ""],
    )
    assert scores == [1.0, 1.0, 1.0, 0.0, None]
    assert module.answer_in_text(["q"], [[{"role": "assistant", "content": "Everest."}]], ["everest"]) == [1.0]
    prompts = write_prompt_data(tmp_path)
    run = ["data=rl", f"data.path={prompts}", "data.tokenizer.kind=byte", "data.reward=[answer_in_text]"]
    run += ["model=llama-tiny", "model.n_layer=2", "train.seq_len=64", "train.batch_size=8", "train.micro_batch_size=4"]
    run += ["rl.group_size=4", "rl.max_new_tokens=6", "train.device=cpu", "logging.wandb.mode=disabled"]
    run += ["train.eval_every=0", "checkpoint.resume=none", "train.save_model=false"]
    parts = build_training(OmegaConf.to_object(compose_config(run)), ALONE, str(tmp_path / "run"))
    records: list[dict] = []
    try:
        Trainer(parts, records.append).advance()
    finally:
        parts.data.close()
    (record,) = records
    assert (
        0.0 <= record["rewards/answer_in_text/mean"] <= 1.0
        and record["rewards/answer_in_text/mean"] == record["reward"]
    )
