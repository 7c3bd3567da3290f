"""Test-only fault injection for runs of the real entry point, loaded through PYTHONPATH by the tests that need it
(tests/test_checkpoint.py); a normal run never imports it. Each variable arms one fault:

  LLMTRAIN_TEST_HANG_AT_STEP=k     step k never finishes (a test then kills the process: a crash mid-run)
  LLMTRAIN_TEST_STEP_SECONDS=s     every step takes at least s seconds (time to send a signal mid-run)
  LLMTRAIN_TEST_INF_AT_STEPS=3,4   those steps' loss and gradients become non-finite (an overflow)
  LLMTRAIN_TEST_INF_GRAD_AT_STEPS=3  those steps' gradients become non-finite, their loss stays finite
  LLMTRAIN_TEST_OOM_AT_STEP=k      step k raises torch.OutOfMemoryError, as the CUDA allocator does
  LLMTRAIN_TEST_HANG_IN_SAVE_AT_STEP=k  checkpoint k's shards are written, then its write never finishes (no
                                   .metadata, no rename): a test kills the run mid-save (in the background thread
                                   under checkpoint.async_save, while training goes on)
  LLMTRAIN_TEST_DISK_FULL_AT_STEP=k  DCP's file writer fails checkpoint k's write with ENOSPC, as a full disk does
  LLMTRAIN_TEST_HOST_READS=FILE    each step appends one line to FILE: how many times the training thread read a
                                   tensor's value on the host (item, tolist, float, int, bool): each one a sync on
                                   a GPU. Reads inside optimizer.step are left out: torch's AdamW keeps its step
                                   counters in host memory on every device, so reading them syncs nothing. The
                                   reads are counted and performed as usual.

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
INF_GRAD_AT = {int(s) for s in os.environ.get("LLMTRAIN_TEST_INF_GRAD_AT_STEPS", "").split(",") if s}
OOM_AT = int(os.environ.get("LLMTRAIN_TEST_OOM_AT_STEP", "0"))
HANG_IN_SAVE_AT = int(os.environ.get("LLMTRAIN_TEST_HANG_IN_SAVE_AT_STEP", "0"))
DISK_FULL_AT = int(os.environ.get("LLMTRAIN_TEST_DISK_FULL_AT_STEP", "0"))
HOST_READS = os.environ.get("LLMTRAIN_TEST_HOST_READS", "")
_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _counting_host_reads(step_fn):
    """step_fn, counting the training thread's host reads of tensor values while it runs."""
    import threading

    import torch

    def counted(self):
        thread, count, in_optimizer = threading.get_ident(), [0], [False]
        originals = {name: getattr(torch.Tensor, name) for name in _READS}

        def spy(original):
            def read(tensor, *args, **kwargs):
                if threading.get_ident() == thread and not in_optimizer[0]:
                    count[0] += 1
                return original(tensor, *args, **kwargs)

            return read

        optimizer_step = self.optimizer.step

        def step_uncounted(*args, **kwargs):
            in_optimizer[0] = True
            try:
                return optimizer_step(*args, **kwargs)
            finally:
                in_optimizer[0] = False

        for name, original in originals.items():
            setattr(torch.Tensor, name, spy(original))
        self.optimizer.step = step_uncounted
        try:
            return step_fn(self)
        finally:
            del self.optimizer.step
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            with open(HOST_READS, "a") as f:
                f.write(f"{count[0]}\n")

    return counted


def _hang_in_save(step: int) -> None:
    """DCP's file writer writes checkpoint `step`'s shards and then never returns."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def writing_then_hanging(self, plan, planner):
        written = write_data(self, plan, planner)
        if f"step-{step:08d}.tmp" in str(self.path):
            written.wait()  # the shards are on disk
            while True:
                time.sleep(1)
        return written

    FileSystemWriter.write_data = writing_then_hanging


def _disk_full_in_save(step: int) -> None:
    """DCP's file writer fails checkpoint `step`'s write as a full disk does."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if f"step-{step:08d}.tmp" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing


def _patch(loop) -> None:
    if HANG_IN_SAVE_AT:
        _hang_in_save(HANG_IN_SAVE_AT)
    if DISK_FULL_AT:
        _disk_full_in_save(DISK_FULL_AT)
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
        if step in INF_AT or step in INF_GRAD_AT:
            forward_backward = self.strategy.forward_backward

            def overflowing(model, micro_batches, precision):
                loss = forward_backward(model, micro_batches, precision)
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(float("inf"))
                return loss * float("inf") if step in INF_AT else loss

            self.strategy.forward_backward = overflowing
            try:
                record = original(self)
            finally:
                del self.strategy.forward_backward
        else:
            record = original(self)
        time.sleep(max(0.0, STEP_SECONDS - (time.perf_counter() - started)))
        return record

    loop.Trainer.train_step = _counting_host_reads(train_step) if HOST_READS else train_step


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


if HANG_AT or STEP_SECONDS or INF_AT or INF_GRAD_AT or OOM_AT or HANG_IN_SAVE_AT or DISK_FULL_AT or HOST_READS:
    sys.meta_path.insert(0, _PatchOnImport())
