"""A peer's death, told from a bug: when a rank's process ends mid-run (SIGKILL, a segfault, the OOM killer, a
lost node), every rank left fails in its next collective with the backend's message (gloo: "Connection closed by
peer", "Connection reset by peer"; NCCL: a DistBackendError or a remote error). `peer_lost` turns such an error
into PeerLost: each rank left posts itself to the job's store (torchrun's agent keeps it, whichever worker died)
and waits a few seconds for the others; the ranks that never post are named as the ones that ended, by the lowest
rank left, in one line, and every rank left exits PEER_LOST_EXIT to be restarted (torchrun --max-restarts) or
requeued (launch/slurm.sbatch) from the last complete checkpoint."""

from __future__ import annotations

import re

import torch.distributed as dist

from llmtrain.errors import PEER_LOST_EXIT, PeerLost
from llmtrain.process.runtime import Runtime, roll_call

# What the backends say when the other end of a connection has gone.
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)
ROLL_CALL_SECONDS = 5.0
STORE_PREFIX = "llmtrain/left"


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error` is a collective failing because a peer's process ended."""
    if isinstance(error, dist.DistNetworkError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in PEER_GONE)


def peer_lost(error: BaseException, runtime: Runtime) -> tuple[PeerLost, bool]:
    """PeerLost for this rank, naming the ranks that did not answer the roll call (none: every rank answered, the
    loss is a link's, or the store has gone too), and whether this rank says it: the lowest rank left does."""
    answered = set(roll_call(runtime, STORE_PREFIX, "1", ROLL_CALL_SECONDS))
    gone = [rank for rank in range(runtime.world_size) if rank not in answered]
    who = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} ended" if gone else "a peer ended"
    lost = PeerLost(
        f"{who} mid-run (killed, crashed or its node lost; rank {runtime.rank} saw: {_first_line(error)}); the ranks "
        f"left exit {PEER_LOST_EXIT} to be restarted or requeued from the last complete checkpoint"
    )
    return lost, not answered or runtime.rank == min(answered)


def _first_line(error: BaseException) -> str:
    """The error's first sentence, without gloo's source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:160]
