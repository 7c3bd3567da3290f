"""llmtrain's entry point: `python train.py [group=option ...] [key=value ...]`; `--help` lists every group.

Hydra composes conf/train.yaml with the overrides, checks them against the schemas in llmtrain/config/, makes the
run directory and hands the config to llmtrain.run.job.run; a config it cannot compose ends in one `error:` line
(exit 2).
"""

import logging
import os
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from llmtrain.config import RootConfig, register_schemas, validate
from llmtrain.config.composition import job, run_entry
from llmtrain.errors import ConfigError
from llmtrain.faults import check_armed
from llmtrain.parallel_plan import check_layout
from llmtrain.process.launch_env import launch_coordinates, launch_rank, restart_count, under_a_restarting_agent
from llmtrain.process.run_dir import exit_with_config_error

register_schemas()
# This file's path, for the workers a launcher starts (under submitit, sys.argv[0] is submitit's own script).
ENTRY_POINT = os.path.abspath(__file__)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@job
def main(cfg) -> None:
    from llmtrain.train.preemption import PreemptionWatch

    if restart_count() > 0:  # a restart after the run ended on purpose leaves before checking anything
        from llmtrain.run.exits import leave_if_ended_on_purpose

        leave_if_ended_on_purpose()
    # Watching before torch loads: a preemption signal during start-up is acted on at the first step boundary.
    with PreemptionWatch() as preemption:
        try:
            overrides = list(HydraConfig.get().overrides.task)
            if cfg.model.init_from:  # reads its config.json (loads torch): its model, where no preset is chosen
                cfg = _with_init_from_model(cfg, overrides)
            validate(cfg)  # before torch is imported: a bad key or layout answers in a second, on the main rank only
            armed = check_armed()
            _, world_size, _, launcher = launch_coordinates()
            if launcher != "none" or cfg.parallel.nproc <= 1:  # else the workers it starts check their own world
                check_layout(cast(RootConfig, OmegaConf.to_object(cfg)), overrides, world_size)
            from llmtrain.data.files import check_data_files  # loads torch: after the config's own checks

            check_data_files(cfg.data)
        except ConfigError as error:
            if launch_rank() == 0 and under_a_restarting_agent():  # its restarts leave at once, not check it again
                from llmtrain.process.runtime import record_end_on_purpose

                record_end_on_purpose(None, ConfigError.exit_code, f"error: {error}")
            exit_with_config_error(error, HydraConfig.get().runtime.output_dir, is_main=launch_rank() == 0)
        if armed and launch_rank() == 0:
            logging.getLogger("llmtrain").warning(armed)
        from llmtrain.run.job import run

        run(cfg, preemption, ENTRY_POINT)


def _with_init_from_model(cfg, overrides: list[str]):
    """`cfg` with model.init_from's own model where the command line chose no preset, recorded as the run's config
    (.hydra/config.yaml, which Hydra wrote with the default preset's)."""
    from llmtrain.model.hf_adopted import with_init_from_model

    adopted = with_init_from_model(cfg, overrides)
    subdir = HydraConfig.get().output_subdir
    if adopted is not cfg and subdir is not None:
        OmegaConf.save(adopted, os.path.join(HydraConfig.get().runtime.output_dir, subdir, "config.yaml"))
    return adopted


if __name__ == "__main__":
    run_entry(main, RootConfig)
