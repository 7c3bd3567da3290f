"""How long a collective takes: the hardware config's link bandwidths, or a comm_bench CSV measured on the machine.

A collective of `bytes` over n ranks moves bytes x factor over each rank's link (nccl-tests' bus bandwidth
factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, point-to-point 1), so its time is
bytes x factor / bus bandwidth. From the hardware config the bus bandwidth is the link's: intra_node_gbps when
the group's ranks share a node, inter_node_gbps when it spans nodes. From a comm_bench CSV it is the measured bus
bandwidth of that op at the nearest message sizes (log-linear between them), which includes the latency that
small messages pay.
"""

from __future__ import annotations

import bisect
import csv
import math
import os
from collections import defaultdict

from llmtrain.errors import ConfigError

CSV_HEADER = ("op", "bytes", "ranks", "time_us", "algbw_GBps", "busbw_GBps")  # comm_bench.csv
# comm_bench's op names for the ops a plan counts
_BENCH_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
             "send": "send_recv", "recv": "send_recv"}  # fmt: skip


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw: the fraction of the buffer each rank's link carries, so that busbw is comparable
    with the hardware's bandwidth whatever the number of ranks."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (ranks - 1) / ranks
    if op in ("broadcast", "send_recv", "send", "recv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


class Links:
    """Seconds per collective, from the hardware's link numbers or from a measured comm_bench CSV."""

    def __init__(self, intra_node_gbps: float, inter_node_gbps: float, measured: str | None = None):
        self.intra, self.inter = intra_node_gbps, inter_node_gbps
        self.measured = read_comm_bench(measured) if measured else None
        self.source = f"measured ({measured})" if measured else "hardware config"

    def bus_gbps(self, op: str, message_bytes: float, spans_nodes: bool) -> float:
        curve = self.measured.get(_BENCH_OP.get(op, op)) if self.measured else None
        if not curve:
            return self.inter if spans_nodes else self.intra
        sizes = [size for size, _ in curve]
        i = bisect.bisect_left(sizes, message_bytes)
        if i == 0:
            return curve[0][1]
        if i == len(curve):
            return curve[-1][1]
        (s0, b0), (s1, b1) = curve[i - 1], curve[i]
        w = (math.log(message_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + w * (b1 - b0)

    def seconds(self, op: str, total_bytes: float, message_bytes: float, group: int, spans_nodes: bool) -> float:
        """Time of `total_bytes` moved by messages of `message_bytes` over a group of `group` ranks."""
        if total_bytes <= 0 or group <= 1 or op == "recv":  # a receive is the time of its matching send
            return 0.0
        return total_bytes * bus_factor(op, group) / (self.bus_gbps(op, message_bytes, spans_nodes) * 1e9)


def read_comm_bench(path: str) -> dict[str, list[tuple[float, float]]]:
    """op -> [(bytes, bus GB/s)] sorted by size, from comm_bench.csv; a one-line ConfigError if unreadable."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError(
            f"plan.measured={path!r} does not exist: write it with torchrun --nproc_per_node=N -m "
            f"llmtrain.bench.comm_bench, or unset plan.measured to use the hardware config's links"
        )
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != CSV_HEADER:
            raise ConfigError(
                f"plan.measured={path!r} has columns {reader.fieldnames}, not comm_bench's {','.join(CSV_HEADER)}: "
                f"point it at a comm_bench.csv"
            )
        for row in reader:
            try:
                size, busbw = float(row["bytes"]), float(row["busbw_GBps"])
            except ValueError:
                raise ConfigError(
                    f"plan.measured={path!r}: row {row} is not numeric: rewrite it with comm_bench"
                ) from None
            if busbw > 0:
                curves[row["op"]].append((size, busbw))
    return {op: sorted(points) for op, points in curves.items()}
