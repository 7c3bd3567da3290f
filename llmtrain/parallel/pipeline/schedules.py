"""`parallel.pp_schedule` name -> how the micro-batches flow, and what each schedule needs.

gpipe             all m forwards, then all m backwards: bubble (p-1)/m, m micro-batches of activations alive.
1f1b              warm-up, then one forward / one backward: same bubble, at most p - rank alive.
1f1b_reference    1f1b written here from isend/irecv (reference.py), for reading and testing.
interleaved_1f1b  v virtual stages per rank, dealt round-robin: bubble (p-1)/(v·m) for v times the messages.
zero_bubble       interleaved, with backward split into input-gradient B (on the critical path) and weight-
                  gradient W (deferred into the bubbles): ZB-1P of Qi et al. 2023.
zbv               zero bubble with two stages per rank in a V (rank r holds stages r and 2p-1-r).
dualpipev         DeepSeek's DualPipe folded into a V: forwards and backwards of two micro-batches overlap.
"""

from __future__ import annotations

import torch.distributed.pipelining

from llmtrain.catalog import SCHEDULES, ScheduleSpec
from llmtrain.errors import ConfigError


def schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={name!r} is not a pipeline schedule: use one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


def torch_schedule(spec: ScheduleSpec) -> type | None:
    """torch's class for a schedule (None for the reference written here, reference.py)."""
    return None if spec.torch_class is None else getattr(torch.distributed.pipelining, spec.torch_class)


def fewest_stages_per_rank(name: str) -> int:
    """The smallest parallel.pp_stages_per_rank the schedule runs with."""
    return 1 if schedule_spec(name).stages_per_rank == "one" else 2


def validate_schedule(name: str, pp: int, stages_per_rank: int, microbatches: int, compiled: bool = False) -> None:
    spec = schedule_spec(name)
    if compiled and spec.splits_backward:
        raise ConfigError(
            f"train.compile=true does not work with parallel.pp_schedule={name}, which computes input "
            f"and weight gradients in separate passes over the graph: set train.compile=false or "
            f"use 1f1b / interleaved_1f1b"
        )
    v = stages_per_rank
    if spec.stages_per_rank == "one" and v != 1:
        raise ConfigError(
            f"parallel.pp_schedule={name} runs one stage per rank but parallel.pp_stages_per_rank={v}: "
            f"set parallel.pp_stages_per_rank=1, or use interleaved_1f1b / zero_bubble"
        )
    if spec.stages_per_rank == "several" and v < 2:
        raise ConfigError(
            f"parallel.pp_schedule={name} interleaves virtual stages but parallel.pp_stages_per_rank"
            f"={v}: set parallel.pp_stages_per_rank=2 or more (model.n_layer must split into "
            f"pp x that many stages)"
        )
    if spec.stages_per_rank == "two" and v != 2:
        raise ConfigError(
            f"parallel.pp_schedule={name} places exactly two stages per rank in a V but "
            f"parallel.pp_stages_per_rank={v}: set parallel.pp_stages_per_rank=2"
        )
    least = {"1": 1, "pp": pp, "stages": pp * v}[spec.microbatches_at_least]
    if microbatches < least:
        raise ConfigError(
            f"parallel.microbatches={microbatches} is below {least}, which parallel.pp_schedule={name} "
            f"needs with parallel.pp={pp} (fewer micro-batches than stages leaves ranks idle): set "
            f"parallel.microbatches >= {least}"
        )
    if spec.microbatches_multiple_of_pp and microbatches % pp:
        raise ConfigError(
            f"parallel.microbatches={microbatches} is not a multiple of parallel.pp={pp}, which "
            f"parallel.pp_schedule={name} runs in rounds of: use a multiple of {pp}"
        )
