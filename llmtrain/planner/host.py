"""What a CPU host offers a rank when the hardware config names no device (hardware=cpu): its fp32 matmul rate, its
memory bandwidth and its memory, measured here (a device's are the hardware config's numbers)."""

from __future__ import annotations

import os
import time


def host_matmul_flops(ranks_per_node: int) -> float:
    """A CPU rank's fp32 matmul FLOP/s, timed here: the machine's cores are shared by the node's ranks."""
    import torch

    n, reps = 512, 8
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    measured = 2 * n**3 * reps / (time.perf_counter() - start)
    cores = os.cpu_count() or 1
    return measured * min(1.0, cores / ranks_per_node / torch.get_num_threads())


def host_memory_bandwidth(ranks_per_node: int) -> float:
    """A CPU rank's memory bandwidth (bytes/s), timed here by copying a buffer larger than the caches: the node's
    ranks share the memory's channels."""
    import torch

    source = torch.ones(8 * 2**20)  # 32 MiB
    target = torch.empty_like(source)
    target.copy_(source)
    reps = 4
    start = time.perf_counter()
    for _ in range(reps):
        target.copy_(source)
    moved = 2 * source.numel() * source.element_size() * reps  # read and written
    return moved / (time.perf_counter() - start) / ranks_per_node


def total_memory_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
