"""The planner on a live run, on its own device and ranks: the hardware config that describes the device
(hardware.py), `parallel=auto` decided on rank 0 (auto.py, with the links measured on this machine when the config
names none: probe.py) and handed to every rank, and so is rl.gather_weights=auto (how a rollout gathers FSDP's
weights); and, for the end summary, what the planner predicts for the layout the run used."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace
from typing import cast

import torch

from llmtrain.catalog import AUTO, OBJECTIVES, objective_of
from llmtrain.config import HardwareConfig, RootConfig
from llmtrain.errors import ConfigError
from llmtrain.parallel.precision import uses_bf16
from llmtrain.planner.auto import AutoLayout, auto_layout, prediction
from llmtrain.planner.hardware import hardware_for_device
from llmtrain.planner.probe import probe_links
from llmtrain.process.launch_env import ranks_per_node
from llmtrain.process.runtime import Runtime

log = logging.getLogger("llmtrain")


def resolved_for_device(config: RootConfig, runtime: Runtime, vocab_size: int) -> tuple[RootConfig, bool]:
    """Collective: `config` with the hardware of this run's device and, under parallel=auto, the layout the planner
    chose and the train.* knobs it turned so that it fits (what W&B and the summaries show); and whether the planner
    chose the layout. A ConfigError, on every rank, where it cannot."""
    hardware = _device_hardware(config, runtime)
    if isinstance(hardware, HardwareConfig) and hardware is not config.hardware:
        if runtime.is_main:
            log.info(f"hardware  {hardware.name} (conf/hardware/{hardware.name}.yaml), the config of this run's device")
        config = replace(config, hardware=hardware)
    if config.parallel.layout != AUTO:
        return _gathering_resolved(config, runtime, vocab_size), False
    if isinstance(hardware, str):
        raise ConfigError(f"parallel=auto cannot plan for this device: {hardware}")
    if config.plan.measured is None and runtime.world_size > 1:  # measure first: the links this machine has
        config = replace(config, plan=replace(config.plan, measured=_measured_links(config, runtime)))
    mine = _decided_on_main(config, runtime, vocab_size) if runtime.is_main else None
    decided = cast("AutoLayout | ConfigError", runtime.from_main(mine))  # rank 0's: a decision
    if isinstance(decided, ConfigError):  # raised on every rank: none is left waiting for the others
        raise decided
    config = replace(config, parallel=decided.parallel, train=replace(config.train, **decided.train))
    log.info(decided.summary)
    return _gathering_resolved(config, runtime, vocab_size), True


def _gathering_resolved(config: RootConfig, runtime: Runtime, vocab_size: int) -> RootConfig:
    """Collective: rl.gather_weights=auto decided where a step samples: `once` where rank 0's planner finds the
    whole model fits beside the rollout's cache, else `per_token`."""
    objective = OBJECTIVES[objective_of(config.train.objective, config.data.source)]
    if config.rl.gather_weights != AUTO or not objective.samples:
        return config
    mine = bool(predicted(config, runtime, vocab_size).get("gathers_once", False)) if runtime.is_main else None
    gathering = "once" if runtime.from_main(mine) else "per_token"
    return replace(config, rl=replace(config.rl, gather_weights=gathering))


def predicted(config: RootConfig, runtime: Runtime, vocab_size: int) -> dict:
    """The planner's prediction for this run's layout on its device (rank 0; the hardware config's links, or
    plan.measured), or why there is none."""
    hardware = _device_hardware(config, runtime)
    if isinstance(hardware, str):
        return {"unavailable": hardware}
    bf16 = uses_bf16(config.train.precision, runtime.device)
    per_node = min(ranks_per_node(), runtime.world_size)
    return prediction(config, runtime.world_size, per_node, vocab_size, bf16)


def _decided_on_main(config: RootConfig, runtime: Runtime, vocab_size: int) -> AutoLayout | ConfigError:
    """parallel=auto's choice for this world, or the ConfigError saying why there is none (decided on rank 0, which
    times the host when the hardware gives no peak, and handed to every rank)."""
    bf16 = uses_bf16(config.train.precision, runtime.device)
    per_node = min(ranks_per_node(), runtime.world_size)
    try:
        return auto_layout(config, config.parallel, runtime.world_size, per_node, vocab_size, bf16)
    except ConfigError as error:
        return error


def _measured_links(config: RootConfig, runtime: Runtime) -> str:
    """Collective: a comm_bench CSV of this machine's collectives over all ranks, measured once (a few seconds) and
    cached in data.cache_dir per host, world size, ranks per node and device; its path, the same on every rank."""
    device = _device_name(runtime.device)
    name = f"{socket.gethostname()}-{runtime.world_size}x-{ranks_per_node()}pernode-{device}".replace(" ", "_")
    path = os.path.join(os.path.expanduser(config.data.cache_dir), "links", f"{name}.csv")
    path, cached = runtime.from_main((path, os.path.exists(path)))
    when = "cached"
    if not cached:
        started = time.perf_counter()
        probe_links(runtime, path)
        runtime.barrier()
        when = f"in {time.perf_counter() - started:.1f} s"
    log.info(f"parallel=auto plans with the collectives measured on this machine ({when}): {path}")
    return path


def _device_hardware(config: RootConfig, runtime: Runtime) -> HardwareConfig | str:
    """The hardware config of the device this run is on, or why there is none (hardware.py)."""
    return hardware_for_device(config.hardware, runtime.device.type, _device_name(runtime.device))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
