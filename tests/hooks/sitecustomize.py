"""Test-only fault injection for runs of the real entry point, loaded through PYTHONPATH by the tests that need it
(tests/test_checkpoint.py); a normal run never imports it. Each variable arms one fault:

  LLMTRAIN_TEST_HANG_AT_STEP=k     step k never finishes (a test then kills the process: a crash mid-run)
  LLMTRAIN_TEST_STEP_SECONDS=s     every step takes at least s seconds (time to send a signal mid-run)
  LLMTRAIN_TEST_INF_AT_STEPS=3,4   those steps' loss and gradients become non-finite (an overflow)
  LLMTRAIN_TEST_OOM_AT_STEP=k      step k raises torch.OutOfMemoryError, as the CUDA allocator does

The trainer is patched when llmtrain.train.loop is first imported, so the entry point itself is untouched.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

HANG_AT = int(os.environ.get("LLMTRAIN_TEST_HANG_AT_STEP", "0"))
STEP_SECONDS = float(os.environ.get("LLMTRAIN_TEST_STEP_SECONDS", "0"))
INF_AT = {int(s) for s in os.environ.get("LLMTRAIN_TEST_INF_AT_STEPS", "").split(",") if s}
OOM_AT = int(os.environ.get("LLMTRAIN_TEST_OOM_AT_STEP", "0"))


def _patch(loop) -> None:
    original = loop.Trainer.train_step

    def train_step(self):
        step = self.state.step + 1
        if step == HANG_AT:
            while True:
                time.sleep(1)
        if step == OOM_AT:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated by the test)")
        started = time.perf_counter()
        if step in INF_AT:
            forward_backward = self.strategy.forward_backward

            def overflowing(model, micro_batches, precision):
                loss = forward_backward(model, micro_batches, precision)
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(float("inf"))
                return loss * float("inf")

            self.strategy.forward_backward = overflowing
            try:
                record = original(self)
            finally:
                del self.strategy.forward_backward
        else:
            record = original(self)
        time.sleep(max(0.0, STEP_SECONDS - (time.perf_counter() - started)))
        return record

    loop.Trainer.train_step = train_step


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "llmtrain.train.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if HANG_AT or STEP_SECONDS or INF_AT or OOM_AT:
    sys.meta_path.insert(0, _PatchOnImport())
