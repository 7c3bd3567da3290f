"""llmtrain's entry point: `python train.py [group=option ...] [key=value ...]`; `--help` lists every group.

Hydra composes conf/train.yaml with the overrides, checks them against the schemas in llmtrain/config.py, makes the
run directory and hands the config to llmtrain.job.run; a config it cannot compose ends in one `error:` line (exit 2).
"""

import os

import hydra
from hydra.core.hydra_config import HydraConfig

from llmtrain.config import RootConfig, register_schemas, validate
from llmtrain.entry import job, run_entry
from llmtrain.errors import ConfigError
from llmtrain.resolvers import launch_rank
from llmtrain.run_dir import exit_with_config_error

register_schemas()
# This file's path, for the workers a launcher starts (under submitit, sys.argv[0] is submitit's own script).
ENTRY_POINT = os.path.abspath(__file__)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@job
def main(cfg) -> None:
    from llmtrain.train.preemption import PreemptionWatch

    # Watching before torch loads: a preemption signal during start-up is acted on at the first step boundary.
    with PreemptionWatch() as preemption:
        try:
            validate(cfg)  # before torch is imported: a bad key answers in a second, on the main rank only
        except ConfigError as error:
            exit_with_config_error(error, HydraConfig.get().runtime.output_dir, is_main=launch_rank() == 0)
        from llmtrain.job import run

        run(cfg, preemption, ENTRY_POINT)


if __name__ == "__main__":
    run_entry(main, RootConfig)
