"""`parallel=single`: one process, no wrapper. Every other layout is tested against it."""

from llmtrain.config import ConfigError
from llmtrain.parallel.registry import register
from llmtrain.parallel.strategy import Strategy
from llmtrain.runtime import Runtime


@register("single")
class Single(Strategy):
    def __init__(self, cfg, runtime: Runtime):
        if runtime.world_size != 1:
            raise ConfigError(f"parallel=single runs one process but the world size is {runtime.world_size}: "
                              f"launch without torchrun or pick a multi-process layout (parallel=ddp, fsdp, ...)")
        super().__init__(cfg, runtime)
