"""Hugging Face interop and sampling: a checkpoint exported as GPT-2 loads in transformers with our logits, a GPT-2
in HF format loads into our model (model.init_from) with theirs, and generation agrees with transformers'."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.multiprocessing as mp
from harness.paths import REPO
from harness.processes import free_port, join_as_rank, python, rank_slots

from llmtrain.checkpoint.offline import find_checkpoint, load_checkpoint_model
from llmtrain.errors import ConfigError
from llmtrain.export import export
from llmtrain.generate import continuations
from llmtrain.model import build_model
from llmtrain.model.sampling import SamplingSettings
from llmtrain.tools import compose_config

LOGIT_ATOL = 1e-4  # fp32; measured ~1e-6


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    """The reference run's final checkpoint, exported."""
    checkpoint = find_checkpoint(str(reference.run_dir))
    out = tmp_path_factory.mktemp("exported")
    export(checkpoint, str(out))
    return checkpoint, out


@pytest.mark.slow
def test_an_exported_checkpoint_loads_in_transformers_with_our_logits(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = exported
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ours = load_checkpoint_model(checkpoint)
    ids = torch.tensor([tokenizer("import os\nprint(os.getcwd())\n")["input_ids"]])
    with torch.no_grad():
        difference = (ours(ids)[..., : ours.cfg.vocab_size] - theirs(ids).logits).abs().max().item()
    assert difference <= LOGIT_ATOL


@pytest.mark.slow
def test_greedy_sampling_matches_transformers_generate(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = exported
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("def ")["input_ids"]
    (ours,) = continuations(load_checkpoint_model(checkpoint), [prompt], SamplingSettings(12, temperature=0), 0, None)
    expected = theirs.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )[0, len(prompt) :].tolist()
    assert ours == expected


@pytest.mark.slow
def test_the_generate_command_prints_transformers_greedy_continuation(exported):
    """`python -m llmtrain.generate` on the export, greedy: the prompt and the continuation transformers'
    generate gives (both stop at end-of-text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = exported
    command = [python(), "-m", "llmtrain.generate", str(out), "--prompt", "def ", "--max-new-tokens", "20"]
    done = subprocess.run([*command, "--temperature", "0"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("def ")["input_ids"]
    theirs = (
        AutoModelForCausalLM.from_pretrained(out)
        .eval()
        .generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)[
            0, len(prompt) :
        ]
    )
    new = [token for token in theirs.tolist() if token != tokenizer.eos_token_id]
    assert done.stdout == "def " + tokenizer.decode(new) + "\n"


def _hf_gpt2(directory, **shape) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=257, n_positions=256, n_embd=128, n_layer=4, n_head=4, **shape)
    ).save_pretrained(directory)


def test_a_hugging_face_gpt2_initialises_our_model(tmp_path):
    from transformers import GPT2LMHeadModel

    _hf_gpt2(tmp_path)
    cfg = compose_config(["model=tiny", f"model.init_from={tmp_path}"])
    ours = build_model(cfg.model, 257, seed=1).eval()
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 257, (2, 24))
    with torch.no_grad():
        assert (ours(ids)[..., :257] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


def test_a_gpt2_of_another_shape_is_refused_naming_the_keys(tmp_path):
    _hf_gpt2(tmp_path, n_inner=256)
    cfg = compose_config(["model=tiny", f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.d_ff=512 \(theirs: 256\)"):
        build_model(cfg.model, 257, seed=1)


def _sharded_init_from_worker(rank: int, port: int, directory: str, results) -> None:
    """Both layouts in one 2-rank process group: the GPT-2 read straight into FSDP shards and into pipeline stages."""
    join_as_rank(rank, 2, port)
    from transformers import GPT2LMHeadModel

    from llmtrain.model import GPT
    from llmtrain.process.runtime import init_runtime
    from llmtrain.run.build import build_parallel_model

    runtime = init_runtime("cpu")
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = GPT2LMHeadModel.from_pretrained(directory).eval()(ids).logits
    found = {}
    for layout in (["parallel=fsdp"], ["parallel=pp", "parallel.pp_schedule=gpipe", "parallel.microbatches=2"]):
        cfg = compose_config(
            ["model=tiny", f"model.init_from={directory}", "train.batch_size=4", "train.micro_batch_size=2", *layout]
        )
        model = build_parallel_model(cfg, runtime, 257)
        with torch.no_grad():
            if model.name == "fsdp":  # every rank runs the whole model from its shards
                found["fsdp"] = (model.module.eval()(ids)[..., :257] - theirs).abs().max().item()
            weights = model.full_state_dict()  # model.pt's path: one tensor at a time to rank 0
            if runtime.is_main:
                with torch.device("meta"):
                    whole = GPT(model.module.cfg)
                whole.load_state_dict(weights, assign=True)
                found[f"{model.name} model.pt"] = (whole.eval()(ids)[..., :257] - theirs).abs().max().item()
    results.put((rank, found))
    runtime.shutdown(synchronize=True)


@pytest.mark.slow
def test_a_hugging_face_gpt2_loads_straight_into_shards_and_stages(tmp_path):
    _hf_gpt2(tmp_path)
    results = mp.get_context("spawn").Queue()
    with rank_slots(2):
        mp.start_processes(
            _sharded_init_from_worker, args=(free_port(), str(tmp_path), results), nprocs=2, start_method="spawn"
        )
    found = dict(results.get(timeout=300) for _ in range(2))
    assert set(found[0]) == {"fsdp", "fsdp model.pt", "pp model.pt"} and set(found[1]) == {"fsdp"}
    assert max(found[0].values()) <= LOGIT_ATOL and found[1]["fsdp"] <= LOGIT_ATOL, found


def _hf_llama(directory, **shape) -> None:
    """A small random LlamaForCausalLM of llama-tiny's shape (untied, to exercise the separate head), saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=257, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(LlamaConfig(**{**config, **shape})).save_pretrained(directory)


LLAMA = ["model=llama-tiny", "model.tie_embeddings=false"]
# Llama 3's rope scaling, with a pretraining context short enough (16) for 48 tokens to reach every band
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}  # fmt: skip
OUR_LLAMA3_SCALING = [
    "model.rope_scaling.type=llama3",
    "model.rope_scaling.factor=4",
    "model.rope_scaling.original_max_seq_len=16",
]


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["rope", "llama3-scaled rope"])
def test_a_hugging_face_llama_initialises_our_model(tmp_path, scaling):
    from transformers import LlamaForCausalLM

    _hf_llama(tmp_path, rope_scaling=scaling)
    ours_scaling = OUR_LLAMA3_SCALING if scaling else []
    cfg = compose_config([*LLAMA, *ours_scaling, f"model.init_from={tmp_path}"])
    ours = build_model(cfg.model, 257, seed=1).eval()
    theirs = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 257, (2, 48))
    with torch.no_grad():
        assert (ours(ids)[..., :257] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


def test_a_llama_of_another_shape_is_refused_naming_the_keys(tmp_path):
    _hf_llama(tmp_path, num_key_value_heads=2)
    cfg = compose_config([*LLAMA, f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model\.n_kv_head=4 \(theirs: 2\)"):
        build_model(cfg.model, 257, seed=1)


def test_a_llama3_scaled_checkpoint_into_plain_rope_is_refused(tmp_path):
    _hf_llama(tmp_path, rope_scaling=LLAMA3_SCALING)
    cfg = compose_config([*LLAMA, f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model\.rope_scaling=None \(theirs: RopeScaling\(factor=4.0"):
        build_model(cfg.model, 257, seed=1)


@pytest.mark.slow
def test_our_llama_exports_to_transformers_and_generates_the_same(tmp_path, cache_dir):
    """A trained llama-tiny checkpoint (with Llama 3's rope scaling), exported: transformers computes our logits and
    greedy continuation."""
    from harness.runs import FAST, run_train
    from transformers import LlamaForCausalLM

    (tmp_path / "run").mkdir()
    run = run_train(
        tmp_path / "run", cache_dir, *FAST, "model=llama-tiny", *OUR_LLAMA3_SCALING, "train.steps=2", name="llama"
    )
    _assert_export_matches_transformers(run, tmp_path, LlamaForCausalLM)


def _hf_mixtral(directory, **shape) -> None:
    """A small random MixtralForCausalLM of mixtral-tiny's shape, saved (per-expert w1/w2/w3 tensors on disk)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=257, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                  num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=True)  # fmt: skip
    MixtralForCausalLM(MixtralConfig(**{**config, **shape})).save_pretrained(directory)


def test_a_hugging_face_mixtral_initialises_our_model(tmp_path):
    from transformers import MixtralForCausalLM

    _hf_mixtral(tmp_path)
    ours = build_model(compose_config(["model=mixtral-tiny", f"model.init_from={tmp_path}"]).model, 257, seed=1)
    theirs = MixtralForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(ids)[..., :257] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


def test_a_mixtral_of_another_shape_is_refused_naming_the_keys(tmp_path):
    _hf_mixtral(tmp_path, num_experts_per_tok=1)
    cfg = compose_config(["model=mixtral-tiny", f"model.init_from={tmp_path}"])
    with pytest.raises(
        ConfigError, match=r"model\.moe=\(8, 2, 1, 0, 384, True\) \(theirs: \(8, 1, 1, 0, 384, True\)\)"
    ):
        build_model(cfg.model, 257, seed=1)


def test_a_mixture_mixtral_cannot_hold_is_refused_in_one_line(tmp_path):
    _hf_mixtral(tmp_path)
    cfg = compose_config(["model=mixtral-tiny", "model.moe.every=2", f"model.init_from={tmp_path}"])
    with pytest.raises(ConfigError, match="model.moe.every=2") as error:
        build_model(cfg.model, 257, seed=1)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_our_mixtral_exports_to_transformers_and_generates_the_same(tmp_path, cache_dir):
    """A trained mixtral-tiny checkpoint, exported: transformers' MixtralForCausalLM computes our logits and
    greedy continuation."""
    from harness.runs import run_train
    from transformers import MixtralForCausalLM

    (tmp_path / "run").mkdir()
    run = run_train(tmp_path / "run", cache_dir, "model=mixtral-tiny", "train.steps=2", name="mixtral")
    _assert_export_matches_transformers(run, tmp_path, MixtralForCausalLM)


def _assert_export_matches_transformers(run, tmp_path, model_class) -> None:
    """The run's final checkpoint, exported, loads in transformers as `model_class`, whose logits are ours and
    whose greedy continuation is ours."""
    from transformers import AutoModelForCausalLM

    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = find_checkpoint(str(run.run_dir))
    export(checkpoint, str(tmp_path / "exported"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert isinstance(theirs, model_class)
    ours = load_checkpoint_model(checkpoint)
    ids = torch.randint(0, 257, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :257] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL
    prompt = ids[0, :8].tolist()
    (mine,) = continuations(ours, [prompt], SamplingSettings(12, temperature=0), 0, None)
    expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert mine == expected
