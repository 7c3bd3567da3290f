"""The dry run (llmtrain/tools/dry_run.py): one process as rank r of N on fake tensors and fake process groups.
Its oracle is arithmetic, not the dry run itself: at 8 FSDP ranks of a model whose every first dimension splits
evenly, a rank holds exactly 1/8 of the fp32 weights and gradients and of AdamW's two moments (plus one step
counter per tensor), and FSDP2's collectives move what the planner's traffic model says, call for call."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import REPO, python

from llmtrain.errors import ConfigError
from llmtrain.model import meta_model
from llmtrain.tools import compose_config
from llmtrain.tools.dry_run import _checked, _composed, dry_run

TINY = ["model=tiny", "model.vocab_size=256", "train.seq_len=64", "train.micro_batch_size=1"]


@pytest.mark.slow
def test_a_dry_run_of_8_fsdp_ranks_holds_exact_shares_and_moves_the_planned_bytes(tmp_path):
    output = tmp_path / "dry_run.json"
    command = [python(), "-m", "llmtrain.tools.dry_run", "parallel=fsdp", *TINY, "train.batch_size=16"]
    command += ["dry_run.world_size=8", "dry_run.rank=5", f"dry_run.output={output}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dry run   rank 5 of 8: fsdp" in done.stdout
    result = json.loads(output.read_text())
    parameters = list(meta_model(compose_config(TINY).model, 256).parameters())
    weights = 4 * sum(p.numel() for p in parameters)
    assert all(p.shape[0] % 8 == 0 for p in parameters)  # no padding: shares are exact
    kinds = result["kinds"]
    assert kinds["parameters"] == weights // 8 and kinds["gradients"] == weights // 8
    assert kinds["optimizer state"] == 2 * weights // 8 + 4 * len(parameters)
    assert result["bytes"] == result["planned"]["bytes"] and result["calls"] == result["planned"]["calls"]
    assert sum(kinds.values()) <= result["peak"] <= 1.005 * sum(kinds.values())  # kinds read within 0.5% of it


@pytest.mark.parametrize("layout", ["parallel=ddp", "parallel=pp"])
def test_what_fake_tensors_cannot_run_is_refused_in_one_line_naming_an_alternative(layout):
    config = _checked(_composed([layout, *TINY, "train.batch_size=16", "dry_run.world_size=2"]), [layout])
    with pytest.raises(ConfigError, match=r"cannot be dry-run.*; dry-run "):
        dry_run(config)
