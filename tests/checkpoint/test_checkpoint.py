"""Checkpoints: exact resume after a hard kill, preemption signals, resharding across layouts, incomplete
checkpoints, and the non-finite step guard (real runs of train.py; faults armed at llmtrain/faults.py's points)."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness.layouts import MEMORY_MARGIN, release_tier_only
from harness.paths import WORKERS
from harness.processes import kill_hard, rank_processes, torchrun
from harness.runs import (
    LOSS_RTOL,
    PARITY,
    PIPELINE,
    Run,
    assert_parity,
    assert_resumed_exactly,
    killed_mid_run,
    run_stderr,
    run_train,
    start_run,
    steps_logged,
    wait_for_steps,
)
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from llmtrain.checkpoint import checksums, load_final_model
from llmtrain.checkpoint.manager import (
    CheckpointManager,
    IncompleteCheckpoint,
    checkpoint_path,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    read_data_position,
    read_meta,
    restore_rng_states,
    write_data_position,
)
from llmtrain.checkpoint.offline import find_checkpoint, load_checkpoint_model
from llmtrain.checkpoint.training import logged_records, resume_path
from llmtrain.config import CheckpointConfig
from llmtrain.differences import max_relative_difference
from llmtrain.errors import PREEMPTED_EXIT, ConfigError
from llmtrain.faults import arm
from llmtrain.process.runtime import Runtime
from llmtrain.tools import upgrade_checkpoint


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory, cache_dir) -> Path:
    """Checkpoints of an fsdp run on 4 ranks, saved in the background (checkpoint.async_save), killed after step 8:
    what the reshard tests resume under other layouts. (single's and fsdp's exact resumes, random generators
    included, are the tests with dropout.)"""
    return killed_mid_run(
        tmp_path_factory.mktemp("fsdp"), cache_dir, ("parallel=fsdp",), 4, "checkpoint.async_save=true"
    )


@pytest.mark.slow
def test_a_killed_pipeline_run_resumes_bit_identically(tmp_path, cache_dir, layout_run):
    uninterrupted = layout_run(*PIPELINE, nproc=2)
    checkpoints = killed_mid_run(tmp_path, cache_dir, PIPELINE, 2)
    resumed = run_train(
        tmp_path, cache_dir, *PARITY, *PIPELINE, f"checkpoint.dir={checkpoints}", nproc=2, name="resumed"
    )
    assert_resumed_exactly(resumed, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_kill_during_a_checkpoint_write_resumes_from_the_one_before(async_save, tmp_path, cache_dir, reference):
    """Killed while checkpoint 6's shards are on disk but its write has not finished (in the background thread
    under async_save, while training goes on): the torn checkpoint is never taken for complete, and the run resumes
    from checkpoint 3 to the killed run's own records, to the bit. With dropout, every step draws its masks' seeds
    from the random generators, so any weight, AdamW moment, data position or generator not restored would move a
    loss's last bits; the killed run is the uninterrupted run up to its kill. Positive control: dropout does change
    the run."""
    run = (*PARITY, "model.dropout=0.1", "checkpoint.every=3", f"checkpoint.async_save={str(async_save).lower()}")
    process, run_dir = start_run(tmp_path, cache_dir, *run, nproc=0, env=arm(hang_in_save_at_step="6"), name="killed")
    checkpoints, torn = run_dir / "checkpoints", run_dir / "checkpoints" / "step-00000006.tmp"
    wait_for_steps(run_dir, 8 if async_save else 6, process)  # async: training went on past the save
    deadline = time.monotonic() + 120
    while not any(torn.glob("*.distcp")) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_hard(process)
    assert any(torn.glob("*.distcp")) and not (torn / ".metadata").exists()
    assert [Path(p).name for p in complete_checkpoints(str(checkpoints))] == ["step-00000003"]
    # steps 1-6, written before the torn save began (a later line may have been cut short by the kill)
    killed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:6]]
    assert max_relative_difference([m["loss"] for m in killed], [m["loss"] for m in reference.metrics[:6]]) > 1e-3
    resumed = run_train(tmp_path, cache_dir, *run, f"checkpoint.dir={checkpoints}", name="resumed")
    assert f"resumed   from {checkpoints / 'step-00000003'}" in resumed.stdout + resumed.stderr
    assert_repeats(resumed, killed)


@pytest.mark.slow
def test_a_killed_fsdp_run_with_dropout_resumes_bit_identically(tmp_path, cache_dir):
    """As a kill during a checkpoint write, over 2 ranks: each rank's random generators come back (each draws its
    own masks). The killed run logged steps 1-8; the run resumed from its step-5 checkpoint repeats 6-8 to the bit."""
    dropout = ("model.dropout=0.1", "parallel=fsdp")
    checkpoints = killed_mid_run(tmp_path, cache_dir, dropout, 2)
    killed = Run(0, "", "", checkpoints.parent).metrics
    assert len(killed) == 8
    resumed = run_train(
        tmp_path, cache_dir, *PARITY, *dropout, f"checkpoint.dir={checkpoints}", nproc=2, name="resumed"
    )
    assert_repeats(resumed, killed)


def assert_repeats(resumed: Run, killed: list[dict]) -> None:
    """The resumed run logged the killed run's records, to the bit, for every step the killed run logged."""
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed   from" in resumed.stdout + resumed.stderr
    for key in ("loss", "grad_norm", "val_loss"):
        assert [m.get(key) for m in resumed.metrics[: len(killed)]] == [m.get(key) for m in killed], key


@pytest.mark.slow
# Sharded over 4 ranks, continued in one process, tensor-parallel over 2 (each weight resplit along another dimension:
# 2 ranks, not ddp_tp's 4, since 4 tensor-parallel ranks on 2 cores took 100 s) and pipelined over 2 x 2.
@pytest.mark.parametrize("layout, nproc", [("single", 0), ("tp", 2), ("pp_fsdp", 4)])
def test_a_checkpoint_loads_under_another_layout(layout, nproc, fsdp_checkpoints, tmp_path, cache_dir, reference):
    """Saved by fsdp on 4 ranks at step 5; continued under another layout, it follows the uninterrupted run: the
    model, the optimizer state and the data position all carried over (a repeated or skipped batch, or a lost
    AdamW moment, moves the losses by far more than the tolerance). And it did resume rather than start afresh
    (which would match `single` just as well): it says so, its first five records are the saved run's, timings
    included (no fresh run repeats those), and its first step is the uninterrupted run's step 6."""
    step_5 = fsdp_checkpoints / "step-00000005"
    resumed = run_train(tmp_path, cache_dir, *PARITY, f"parallel={layout}", f"checkpoint.resume={step_5}", nproc=nproc)
    assert_parity(resumed, reference)
    assert f"resumed   from {step_5}" in resumed.stdout + resumed.stderr
    saved_run = [json.loads(line) for line in (fsdp_checkpoints.parent / "metrics.jsonl").read_text().splitlines()]
    assert len(saved_run) == 8 and resumed.metrics[:5] == saved_run[:5]
    assert "records" not in read_meta(str(step_5))  # the history stays in metrics.jsonl, not in each checkpoint
    assert resumed.metrics[5]["step"] == 6
    assert resumed.metrics[5]["loss"] == pytest.approx(reference.metrics[5]["loss"], rel=LOSS_RTOL)


@pytest.mark.slow
def test_a_zero1_checkpoint_costs_a_ranks_share_and_restores_every_moment(tmp_path):
    """ZeRO-1 keeps 1/N of the AdamW moments on each rank, and its checkpoint must not gather the rest onto every
    rank (that save peaked at 2.4x and its load at 2.9x this model's fp32 weights here). A save and a load each
    peak within what the rank writes (its share of weights and moments, 3 x weights / N) plus one whole tensor
    (the moment being reassembled) and the margin; a fresh ZeRO-1 model loads its exact slices back (from a
    background save: checkpoint.async_save stages the same state), and one process without a group loads every
    moment bit-exact and the step count."""
    model = "model=tiny model.n_layer=4 model.d_model=512 model.n_head=8 train.seq_len=32 train.micro_batch_size=2"
    torchrun(2, str(WORKERS / "zero_worker.py"), str(tmp_path), model)
    results = json.loads((tmp_path / "results.json").read_text())
    bound = 3 * results["whole_model"] / 2 + results["largest_tensor"] + MEMORY_MARGIN
    assert max(results["save_peaks"] + results["load_peaks"]) <= bound, results
    assert results["zero1_restored_exactly"] == [True, True]
    assert results["single_moment_difference"] == 0.0 and results["single_steps"] == [2.0]


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_with_the_requeue_code(tmp_path, cache_dir):
    process, run_dir = start_run(tmp_path, cache_dir, *PARITY, nproc=0, env=arm(step_seconds="0.5"), name="run")
    wait_for_steps(run_dir, 2, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == PREEMPTED_EXIT, run_stderr(run_dir)[-3000:]
    steps = steps_logged(run_dir)
    assert 2 <= steps < 10
    assert [Path(p).name for p in complete_checkpoints(str(run_dir / "checkpoints"))] == [f"step-{steps:08d}"]
    assert not (run_dir / "summary.json").exists()  # not a completed run


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_all_ranks_at_the_same_step_and_no_restart_trains_on(tmp_path, cache_dir):
    """SIGUSR1 to one of the 2 workers train.py started: both save the same step and exit 75. The launcher may
    restart them (parallel.max_restarts=1), but a restart after a stop must not train on past the checkpoint: it
    leaves at once with 75, which reaches the caller (the batch script that requeues)."""
    process, run_dir = start_run(
        tmp_path,
        cache_dir,
        *PARITY,
        "parallel=ddp",
        "parallel.nproc=2",
        "parallel.max_restarts=1",
        nproc=0,
        ranks=2,
        env=arm(step_seconds="0.5"),
        name="run",
    )
    wait_for_steps(run_dir, 2, process)
    workers = rank_processes(process.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGUSR1)  # one worker only, as a node-local signal would
    assert process.wait(timeout=300) == PREEMPTED_EXIT, run_stderr(run_dir)[-3000:]
    assert run_stderr(run_dir).count("not restarted, as the run had ended on purpose (exit 75)") == 1
    steps = steps_logged(run_dir)
    assert [Path(p).name for p in complete_checkpoints(str(run_dir / "checkpoints"))] == [f"step-{steps:08d}"]
    assert not (run_dir / "summary.json").exists()


ONE_PROCESS = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")


def _tiny_checkpoints(directory: Path, steps: list[int]) -> None:
    for step in steps:
        path = Path(checkpoint_path(str(directory), step))
        dcp.save({"weights": torch.randn(64, 64)}, checkpoint_id=str(path), no_dist=True)
        (path / "meta.json").write_text("{}")
        torch.save({}, path / "data.pt")
        checksums.seal(str(path))


def _resealed(path: Path) -> Path:
    """The checkpoint at `path` with checksums of its files as they now are: what an attacker who changed them
    would write, so that what reads them, not the checksums, is what is tested."""
    (path / checksums.CHECKSUMS).unlink()
    checksums.seal(str(path))
    return path


def _flip(file: Path, count: int = 4096) -> None:
    """`count` bytes in the middle of `file` inverted, its size unchanged: what a failing disk or a bad copy does."""
    data = bytearray(file.read_bytes())
    middle = max(0, len(data) // 2 - count // 2)
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    file.write_bytes(bytes(data))


def test_a_resuming_ranks_share_is_dealt_by_the_sizes_recorded_at_save(tmp_path):
    """checksums.json records each file's size as written, and a resuming job's ranks deal their shares by those:
    a file grown since (here the smallest, now the largest) is still read by the rank the recorded sizes give it,
    so no rank reads the metadata of files it does not hash."""
    _tiny_checkpoints(tmp_path, [5])
    path = Path(checkpoint_path(str(tmp_path), 5))
    listed = checksums.listed_files(str(path))
    assert listed is not None and all(entry["bytes"] == (path / name).stat().st_size for name, entry in listed.items())
    dealt = sorted(listed, key=lambda name: (-int(listed[name]["bytes"]), name))
    grown = dealt[-1] if (len(dealt) - 1) % 2 else dealt[-2]  # a small file that the second of two ranks reads
    with open(path / grown, "ab") as f:
        f.write(b"\0" * (1 << 20))
    assert checksums.damage(str(path), share=(1, 2)) == f"{grown} does not match its checksum"
    assert checksums.damage(str(path), share=(0, 2)) is None


def test_a_damaged_checkpoint_is_named_set_aside_and_the_one_before_resumed(tmp_path, caplog):
    """4 KiB flipped in the newest checkpoint's shard (size unchanged: the size checks pass), or in another's
    data position: resuming with checkpoint.resume=auto names the file in a warning, sets the checkpoint aside as
    step-*.damaged and takes the newest intact one; named explicitly, or exported, it is one line naming the
    file. With none intact left, one line rather than a silent fresh start. Generator states that would run code
    are one line, with no advice to load them unsafely. A checkpoint without checksums is incomplete, and the
    upgrade command, the user's word that it is intact, gives it some."""
    checkpoints = tmp_path / "checkpoints"
    _tiny_checkpoints(checkpoints, [5, 10, 15])
    newest, middle = Path(checkpoint_path(str(checkpoints), 15)), Path(checkpoint_path(str(checkpoints), 10))
    _flip(next(newest.glob("*.distcp")))
    _flip(middle / "data.pt", count=8)
    assert latest_checkpoint(str(checkpoints)) == str(newest)  # complete by its files' presence and sizes
    # two ranks resuming each read half the files, largest first: the damaged shard is in one half
    halves = [checksums.damage(str(newest), share=(index, 2)) for index in range(2)]
    assert sorted(map(str, halves)) == ["None", "__0_0.distcp does not match its checksum"], halves

    for named in (str(newest), str(checkpoints)):
        with pytest.raises(ConfigError, match=r"is damaged: __0_0.distcp does not match its checksum") as error:
            resume_path(OmegaConf.structured(CheckpointConfig(resume=named)), str(tmp_path / "unused"), ONE_PROCESS)
        assert "\n" not in str(error.value) and "weights_only" not in str(error.value)
    with pytest.raises(ConfigError, match=r"step-00000015 is damaged: __0_0.distcp does not match its checksum"):
        find_checkpoint(str(tmp_path))  # export, evaluate and sampling
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        chosen = resume_path(OmegaConf.structured(CheckpointConfig(resume="auto")), str(checkpoints), ONE_PROCESS)
    assert chosen == checkpoint_path(str(checkpoints), 5)
    for step, file in ((15, "__0_0.distcp"), (10, "data.pt")):
        assert f"step-{step:08d} is damaged ({file} does not match its checksum): set aside as" in caplog.text
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step-00000005",
        "step-00000010.damaged",
        "step-00000015.damaged",
    ]

    marker = tmp_path / "code-ran"
    torch.save({"cpu": _RunsCode(marker)}, Path(chosen) / "rng-0.pt")  # generator states that would run code
    with pytest.raises(ConfigError, match=r"rng-0.pt holds more than generator states \(getattr\)") as error:
        restore_rng_states(chosen, 0)
    assert "\n" not in str(error.value) and "weights_only" not in str(error.value) and not marker.exists()

    _flip(next(Path(chosen).glob("*.distcp")))
    with pytest.raises(ConfigError, match="^no intact checkpoint is left in .*3 damaged, set aside as step-"):
        resume_path(OmegaConf.structured(CheckpointConfig(resume="auto")), str(checkpoints), ONE_PROCESS)

    legacy = Path(checkpoint_path(str(tmp_path / "legacy"), 3))
    _tiny_checkpoints(legacy.parent, [3])
    (legacy / checksums.CHECKSUMS).unlink()
    with pytest.raises(IncompleteCheckpoint, match="checksums.json is missing .*upgrade_checkpoint"):
        latest_checkpoint(str(legacy))
    upgrade_checkpoint.main([str(legacy.parent)])
    assert latest_checkpoint(str(legacy.parent)) == str(legacy)
    assert checksums.damage(str(legacy)) is None


@pytest.mark.releases
def test_async_saves_reuse_their_staging_buffers_and_write_each_steps_values(tmp_path):
    """The stager keeps its host copies between saves: the second save must refill them, not write the first's."""
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    manager = CheckpointManager(str(tmp_path), keep=2, use_async=True, runtime=runtime)
    weights = torch.zeros(64, 32)
    for step in (1, 2):
        weights.fill_(step)
        manager.save(step, {"weights": weights}, meta={"step": step}, data_position={})
    manager.wait()
    for step in (1, 2):
        loaded = {"weights": torch.empty(64, 32)}
        load_checkpoint(checkpoint_path(str(tmp_path), step), loaded, distributed=False)
        assert torch.equal(loaded["weights"], torch.full((64, 32), float(step)))


@pytest.mark.parametrize("warn", [True, False])
def test_an_incomplete_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, warn):
    """Skipped either way; reported only where asked (the main rank warns, the others look up quietly)."""
    _tiny_checkpoints(tmp_path, [5, 10, 15])
    next(Path(checkpoint_path(str(tmp_path), 15)).glob("*.distcp")).unlink()  # a lost shard
    shard = next(Path(checkpoint_path(str(tmp_path), 10)).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated one
    (tmp_path / "step-00000020.tmp").mkdir()  # a save that never finished
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        found = complete_checkpoints(str(tmp_path), warn=warn)
        latest = latest_checkpoint(str(tmp_path), warn=warn)
    assert [Path(p).name for p in found] == ["step-00000005"] and latest == found[0]
    reported = ("step-00000015: shard __0_0.distcp is missing", "step-00000010: shard __0_0.distcp is truncated")
    assert all((message in caplog.text) == warn for message in reported), caplog.text


def test_one_lookup_finds_a_checkpoint_for_resume_export_and_sampling(tmp_path):
    """A step-* directory, a directory of them or (export, sampling) a run directory: each caller words its own
    error for an incomplete checkpoint or an empty directory."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    _tiny_checkpoints(checkpoints, [5, 10, 15])
    next(Path(checkpoint_path(str(checkpoints), 15)).glob("*.distcp")).unlink()
    latest, broken = checkpoint_path(str(checkpoints), 10), checkpoint_path(str(checkpoints), 15)
    assert latest_checkpoint(str(checkpoints), warn=False) == latest
    assert latest_checkpoint(str(run_dir)) is None and latest_checkpoint(str(tmp_path / "nothing")) is None
    with pytest.raises(IncompleteCheckpoint, match="shard __0_0.distcp is missing"):
        latest_checkpoint(broken)

    assert find_checkpoint(str(run_dir)) == find_checkpoint(str(checkpoints)) == find_checkpoint(latest) == latest
    with pytest.raises(ConfigError, match="is not a complete checkpoint: shard"):
        find_checkpoint(broken)
    with pytest.raises(ConfigError, match="no complete checkpoint in"):
        find_checkpoint(str(tmp_path))

    def resume(value: str, directory: Path = tmp_path / "fresh"):
        return resume_path(OmegaConf.structured(CheckpointConfig(resume=value)), str(directory), ONE_PROCESS)

    assert resume("auto") is None and resume("auto", checkpoints) == latest and resume("none", checkpoints) is None
    assert resume(str(checkpoints)) == resume(latest) == latest
    for value, message in ((broken, "is not a complete checkpoint"), (str(run_dir), "holds no complete checkpoint")):
        with pytest.raises(ConfigError, match=f"^checkpoint.resume={re.escape(value)} {message}") as error:
            resume(value)
        assert "\n" not in str(error.value)


class _RunsCode:
    """A pickle payload: unpickling it creates `marker` (any other call would run the same way)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_data_position_never_runs_code_when_read(tmp_path):
    """The stream's position (numpy arrays, generator states, nested containers) reads back equal; a data.pt that
    would run code and a pre-upgrade data.pkl are refused in one line without running it; the upgrade command,
    the user's word that a checkpoint is trusted, converts the latter."""
    rng = np.random.default_rng(3)
    position = {"tokens": [np.arange(5), np.arange(3)], "rng": rng.bit_generator.state, "source": None, "epoch": 2}
    write_data_position(str(tmp_path), position)
    read = read_data_position(str(tmp_path))
    assert read["rng"] == position["rng"] and read["source"] is None and read["epoch"] == 2
    assert all(np.array_equal(a, b) and isinstance(a, np.ndarray) for a, b in zip(read["tokens"], position["tokens"]))

    marker = tmp_path / "code-ran"
    torch.save({"epoch": _RunsCode(marker)}, tmp_path / "data.pt")
    with pytest.raises(ConfigError, match=r"data.pt holds more than data and was not loaded") as error:
        read_data_position(str(tmp_path))
    assert "\n" not in str(error.value) and not marker.exists()

    legacy = tmp_path / "step-00000007"
    legacy.mkdir()
    (legacy / "data.pkl").write_bytes(pickle.dumps(position))
    with pytest.raises(ConfigError, match=r"data.pkl, a pickle .* llmtrain.tools.upgrade_checkpoint") as error:
        read_data_position(str(legacy))
    assert "\n" not in str(error.value)
    upgrade_checkpoint.main([str(legacy)])
    assert not (legacy / "data.pkl").exists() and read_data_position(str(legacy))["rng"] == position["rng"]


def test_a_resumed_run_takes_its_history_from_the_metrics_the_saving_run_logged(tmp_path, caplog):
    """A run resuming from step 3 continues the records the saving run logged up to step 3 (a line cut short by a
    crash left out); a checkpoint copied away from its run starts a new history, with a warning."""
    lines = [json.dumps({"step": step, "loss": 10.0 - step}) for step in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
    assert logged_records(str(tmp_path), 3) == [{"step": s, "loss": 10.0 - s} for s in (1, 2, 3)]
    assert len(logged_records(str(tmp_path), 9)) == 5
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        assert logged_records(str(tmp_path / "moved"), 3) == []
    assert "metrics start at step 4" in caplog.text


def test_dcp_metadata_that_would_run_code_is_refused_before_dcp_reads_it(tmp_path):
    _tiny_checkpoints(tmp_path, [5, 10])
    marker = tmp_path / "code-ran"
    (Path(checkpoint_path(str(tmp_path), 10)) / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    assert latest_checkpoint(str(tmp_path), warn=False) == checkpoint_path(str(tmp_path), 5)
    with pytest.raises(IncompleteCheckpoint, match="^.metadata asks for pathlib.Path.touch, which is not checkpoint"):
        latest_checkpoint(checkpoint_path(str(tmp_path), 10))
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["optimizer", "model"])
def test_dcp_entries_that_would_run_code_are_refused_and_never_run(entry, tmp_path):
    """A checkpoint written by DCP itself whose non-tensor entry (an optimizer's learning rate) or model weight is
    an object that runs code when unpickled: torch's own `dcp.load` runs it; llmtrain's one load refuses it in a
    line naming the entry, without running it. Plain numbers and tensors load as before."""
    weights = {"w": torch.randn(4, 4)}
    plain = tmp_path / "plain"
    dcp.save({"model": weights, "optimizer": {"lr": 3e-4, "betas": (0.9, 0.95)}}, checkpoint_id=plain, no_dist=True)
    loaded = {"model": {"w": torch.zeros(4, 4)}, "optimizer": {"lr": 0.0, "betas": (0.0, 0.0)}}
    load_checkpoint(str(plain), loaded, distributed=False)
    assert torch.equal(loaded["model"]["w"], weights["w"]) and loaded["optimizer"] == {"lr": 3e-4, "betas": (0.9, 0.95)}

    marker = tmp_path / "code-ran"
    crafted = tmp_path / "crafted"
    payload = {"model": dict(weights), "optimizer": {"lr": 3e-4, "betas": (0.9, 0.95)}}
    payload[entry]["w" if entry == "model" else "lr"] = _RunsCode(marker)
    dcp.save(payload, checkpoint_id=crafted, no_dist=True)
    with pytest.raises(ConfigError, match=f"holds more than data .*entry {entry}.(w|lr) asks for getattr") as error:
        load_checkpoint(str(crafted), loaded, distributed=False)
    assert "\n" not in str(error.value) and not marker.exists()
    dcp.load(loaded, checkpoint_id=crafted, no_dist=True)  # the payload is real: torch's default planner runs it
    assert marker.exists()


def _carrying_code(source: Path, destination: Path, marker: Path, part: str) -> Path:
    """A copy of the checkpoint `source` whose `part` ("model": a weight; "optimizer": every learning rate) is
    replaced by a payload that creates `marker` when unpickled, written by DCP itself beside the original files,
    as an attacker would."""
    shutil.copytree(source, destination)
    whole = destination.parent / f"{destination.name}.pt"
    dcp_to_torch_save(str(source), str(whole))
    state = torch.load(whole, weights_only=True)
    names = [name for name in state[part] if part == "model" or name.endswith(".lr")]
    for name in names[:1] if part == "model" else names:
        state[part][name] = _RunsCode(marker)
    dcp.save(state, checkpoint_id=str(destination), no_dist=True)
    return _resealed(destination)


@pytest.mark.slow
def test_a_checkpoint_carrying_code_is_refused_by_resume_export_and_evaluate_and_runs_nothing(
    fsdp_checkpoints, train, tmp_path
):
    """An fsdp checkpoint whose data position, learning rates (DCP entries) or weights would run code: resuming
    is refused in one line with exit 2, as are export and evaluate, and the payload never runs."""
    from llmtrain.evaluate import main as evaluate

    marker = tmp_path / "code-ran"
    source = fsdp_checkpoints / "step-00000005"
    position = tmp_path / "position" / source.name
    shutil.copytree(source, position)
    torch.save({"epoch": _RunsCode(marker)}, position / "data.pt")
    _resealed(position)
    rates = _carrying_code(source, tmp_path / "rates" / source.name, marker, "optimizer")
    for crafted, message in (
        (position, "data.pt holds more than data and was not loaded"),
        (rates, "holds more than data in its model and optimizer shards and was not loaded (entry optimizer."),
    ):
        run = train(*PARITY, f"checkpoint.resume={crafted}", name=crafted.parent.name)
        assert run.returncode == 2 and not marker.exists()
        errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], run.stderr[-2000:]
        assert not (run.run_dir / "metrics.jsonl").exists()

    weights = _carrying_code(source, tmp_path / "weights" / source.name, marker, "model")
    with pytest.raises(ConfigError, match="holds more than data .*entry model.") as error:
        load_checkpoint_model(str(weights))  # export's and sampling's reading
    assert "\n" not in str(error.value)
    task = tmp_path / "task.yaml"
    task.write_text("task: words\n")
    with pytest.raises(SystemExit) as exit_code:
        evaluate([str(weights), f"tasks=[{task}]", "train.device=cpu"])
    assert exit_code.value.code == 2 and not marker.exists()


@pytest.mark.slow
def test_a_run_resumes_past_a_damaged_checkpoint_to_the_uninterrupted_run(train, layout_run):
    """The PARITY run under DDP over 2 ranks saving every 3 steps and at its end (checkpoints 9 and 10 kept), 4 KiB
    of the last one's first shard inverted once it is complete (its size unchanged; damage_checkpoint_at_step): the
    rerun's ranks each read a share of its files, and whichever found the damage, both take checkpoint 9: one
    warning names the file, the checkpoint is set aside, and the run resumes to the uninterrupted run, to the bit."""
    ddp = (*PARITY, "parallel=ddp", "checkpoint.every=3")
    first = train(*ddp, env=arm(damage_checkpoint_at_step="10"), name="first", nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = first.run_dir / "checkpoints"
    resumed = train(*ddp, f"checkpoint.dir={checkpoints}", name="resumed", nproc=2)
    output = resumed.stdout + resumed.stderr
    named = [line for line in output.splitlines() if "is damaged" in line]
    assert len(named) == 1 and "step-00000010 is damaged (__0_0.distcp does not match its checksum)" in named[0]
    assert f"resumed   from {checkpoints / 'step-00000009'}" in output, output[-3000:]
    assert_resumed_exactly(resumed, layout_run("parallel=ddp", nproc=2))
    assert (checkpoints / "step-00000010.damaged").is_dir()


@pytest.mark.slow
def test_a_resume_with_another_model_fails_with_one_line(fsdp_checkpoints, train):
    run = train(*PARITY, "model.n_layer=2", f"checkpoint.dir={fsdp_checkpoints}")
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "model.n_layer=2 (checkpoint: 4)" in errors[0], run.stderr[-2000:]


@pytest.mark.slow
def test_non_finite_steps_never_reach_the_weights_or_the_optimizer(train, reference, tmp_path):
    """Step 3 overflows in loss and gradients, step 6 in its gradients alone while its loss stays finite (what a
    bf16 overflow in backward looks like): both are skipped, the weights stay finite, and the checkpoint after step
    6 holds exactly the weights and AdamW state of the one before it."""
    run = train(*PARITY, "checkpoint.every=1", "checkpoint.keep=10", env=arm(inf_at_steps="3", inf_grad_at_steps="6"))
    assert run.returncode == 0, run.stderr[-3000:]
    skipped = [m["step"] for m in run.metrics if m.get("skipped")]
    assert skipped == [3, 6] and not math.isfinite(run.metrics[2]["loss"]) and math.isfinite(run.metrics[5]["loss"])
    assert all(math.isfinite(m["loss"]) for m in run.metrics if m["step"] != 3)
    weights = load_final_model(run.run_dir / "model.pt")
    trained = {name: w for name, w in weights.items() if name != "lm_head.bias"}  # the bias is the -inf padding mask
    assert all(torch.isfinite(w).all() for w in trained.values())
    # Steps 1-2 are the uninterrupted run's; from step 4 on the run differs by one missing update, not by NaNs.
    assert [m["loss"] for m in run.metrics[:2]] == [m["loss"] for m in reference.metrics[:2]]
    later, expected = [m["loss"] for m in run.metrics[3:]], [m["loss"] for m in reference.metrics[3:]]
    assert all(map(math.isfinite, later)) and max_relative_difference(later, expected) > LOSS_RTOL

    checkpoints = run.run_dir / "checkpoints"
    before = _saved_state(checkpoints / "step-00000005", tmp_path)
    after = _saved_state(checkpoints / "step-00000006", tmp_path)
    later_state = _saved_state(checkpoints / "step-00000007", tmp_path)
    # the weights, and AdamW's moments and step counts ("state.<param>.exp_avg", ...); the schedule moves on
    kept = {**before["model"], **{key: value for key, value in before["optimizer"].items() if key.startswith("state.")}}
    assert any(key.endswith(".exp_avg_sq") for key in kept) and any(key.endswith(".step") for key in kept)
    after_kept = {**after["model"], **after["optimizer"]}
    assert all(torch.equal(value, after_kept[key]) for key, value in kept.items())
    fc_in = "blocks.0.mlp.fc_in.weight"
    assert not torch.equal(after["model"][fc_in], later_state["model"][fc_in])


def _saved_state(checkpoint: Path, tmp_path: Path) -> dict:
    """Everything a DCP checkpoint holds (model, AdamW moments and counts, schedule), read in this process."""
    out = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_too_many_non_finite_steps_stop_the_run_naming_the_step(train):
    run = train(*PARITY, "train.max_bad_steps=2", "checkpoint.every=1", env=arm(inf_at_steps="4,5,6"))
    assert run.returncode == 3
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: step 5: 2 steps in a row"), run.stderr[-2000:]
    # Step 4 left the weights as step 3 did, so its checkpoint is good; step 5 stopped the run before saving.
    names = [Path(p).name for p in complete_checkpoints(str(run.run_dir / "checkpoints"))]
    assert names == ["step-00000003", "step-00000004"]


@pytest.mark.slow
def test_out_of_memory_is_one_line_naming_the_rank_the_step_and_the_knobs(train):
    run = train(*PARITY, "checkpoint.every=1", env=arm(oom_at_step="3"))
    assert run.returncode == 4
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 ran out of cpu memory in step 3 ("), run.stderr
    assert "Traceback" not in run.stderr
    for knob in ("train.micro_batch_size (now 2", "train.activation_checkpointing=", "parallel=fsdp", "tools.plan"):
        assert knob in errors[0]
    names = [Path(p).name for p in complete_checkpoints(str(run.run_dir / "checkpoints"))]
    assert names == ["step-00000001", "step-00000002"]  # what was saved before it stays


@pytest.mark.slow
def test_a_host_allocation_failure_while_building_is_one_line_with_the_knobs(train):
    """A vocabulary of 2^40 rows: the host allocator refuses the embedding at once (a RuntimeError, not torch's
    OutOfMemoryError), which used to end in its traceback."""
    run = train("model.vocab_size=1099511627776", "train.steps=1")
    assert run.returncode == 4, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 ran out of cpu memory while building the model")
    assert "train.micro_batch_size" in errors[0] and "Traceback" not in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(async_save, train, tmp_path):
    """Checkpoint 4's write fails as a full disk makes it fail (ENOSPC inside DCP's writer): one line naming the
    directory, the cause and the fix, exit 5, its partial directory removed, checkpoint 2 still complete, and
    (after the background write's failure) a rerun resumes from it."""
    save = ("checkpoint.every=2", "train.steps=6", f"checkpoint.async_save={str(async_save).lower()}")
    run = train(*save, env=arm(disk_full_at_step="4"), name="full")
    assert run.returncode == 5, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    checkpoints = run.run_dir / "checkpoints"
    assert len(errors) == 1 and errors[0] == (
        f"error: checkpoint step-00000004 could not be written to {checkpoints} (No space left on device); "
        "step-00000002 is intact and a rerun resumes from it: free space on that disk (older step-* directories "
        "can go), lower checkpoint.keep, or set checkpoint.dir to another disk"
    ), run.stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002"]
    if not async_save:  # the same checkpoint 2 either way; the background writer's failure is the later one
        return
    resumed = train(*save, f"checkpoint.dir={checkpoints}", name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed   from {checkpoints / 'step-00000002'}" in resumed.stdout + resumed.stderr


@pytest.mark.slow
@pytest.mark.releases
@release_tier_only
def test_an_async_checkpoint_resumes_the_run_exactly(train):
    """torch 2.11's stager served one save only (KeyError: <class 'type'> at the second): two async saves, then a
    resume from the first repeats the uninterrupted run's later losses."""
    saving = ("train.steps=4", "checkpoint.every=2", "checkpoint.async_save=true")
    first = train(*saving, name="first")
    assert first.returncode == 0, first.stderr[-3000:]
    step_2 = first.run_dir / "checkpoints" / "step-00000002"
    resumed = train(*saving, f"checkpoint.resume={step_2}", name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = [r["loss"] for r in first.metrics if r["step"] > 2]
    assert [r["loss"] for r in resumed.metrics if r["step"] > 2] == pytest.approx(later, rel=LOSS_RTOL)
