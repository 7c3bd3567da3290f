"""What a start and a restart at scale cost the job's store: a real TCPStore on loopback, one client connection per
simulated rank (threads in a few processes), each rank doing what a worker does through the store when an agent
starts it (llmtrain/process/runtime.py): agreeing on the attempt's name, then a roll call (the one a lost peer or a
hang makes, the watchdog's and peer_loss's). Then the same ranks start again on the same store, as after a restart,
in a shuffled order with rank 0 last, over what the first attempt left. Printed: the store calls a rank makes (rank
0's and the most any other makes) and the wall time, for llmtrain's way and for the polling it replaced (the
baseline, kept here to measure against).

    python -m llmtrain.bench.startup_store                     # 1,024 ranks: rank 0 alone, the rest in 4 processes
    python -m llmtrain.bench.startup_store --ranks 256 --processes 2
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import random
import threading
import time
from collections import Counter
from typing import Any, cast

import torch.distributed as dist

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.process.runtime import agree_on_attempt, gather_posts

# How long a rank waits on the store before its start counts as failed
TIMEOUT = datetime.timedelta(minutes=2)
WAYS = ("llmtrain", "polling")


class CountedStore:
    """A store connection that counts the calls made through it, by method."""

    def __init__(self, store: dist.Store):
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, method: str) -> Any:
        call = getattr(self._store, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[method] += 1
            return call(*args, **kwargs)

        return counted


def polling_agreement(store: dist.Store, rank: int, world_size: int) -> str:
    """The baseline: the agreement as it was before issue 76, rank 0 polling each unconfirmed rank's keys at
    20 Hz (a check, a check and a get a rank)."""
    hello_key, answer_key, confirmed_key = "join/hello", "join/answer", "join/ok"
    if rank != 0:
        hello = os.urandom(16).hex()
        store.set(f"{hello_key}/{rank}", hello)
        name = store.get(f"{answer_key}/{hello}").decode()
        store.set(f"{confirmed_key}/{name}/{rank}", "")
        return name
    name = str(store.add("join/drawn", 1))
    answered: dict[int, bytes] = {}
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0: {len(waiting)} ranks unconfirmed after {TIMEOUT}")
        for peer in sorted(waiting):
            if store.check([f"{confirmed_key}/{name}/{peer}"]):
                waiting.discard(peer)
            elif store.check([f"{hello_key}/{peer}"]) and (posted := store.get(f"{hello_key}/{peer}")) != answered.get(
                peer
            ):
                store.set(f"{answer_key}/{posted.decode()}", name)
                answered[peer] = posted
        time.sleep(0.05 if waiting else 0)
    return name


def polling_roll_call(store: dist.Store, rank: int, world_size: int, prefix: str, mine: str) -> dict[int, bytes]:
    """The baseline roll call: a key a rank, every rank checking them all at 10 Hz, then reading each."""
    store.set(f"{prefix}/{rank}", mine)
    keys = [f"{prefix}/{peer}" for peer in range(world_size)]
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {peer: store.get(key) for peer, key in enumerate(keys) if store.check([key])}


def _rank_starts(way: str, connection: dist.Store, rank: int, world_size: int, attempt: int) -> dict[str, Any]:
    store = CountedStore(dist.PrefixStore(way, connection))
    started = time.time()
    name, posts = None, {}
    try:
        if way == "llmtrain":
            name = agree_on_attempt(cast(dist.Store, store), rank, world_size, TIMEOUT)
            posts = gather_posts(cast(dist.Store, store), rank, world_size, f"roll/{attempt}", str(rank), 60)
        else:
            name = polling_agreement(cast(dist.Store, store), rank, world_size)
            posts = polling_roll_call(cast(dist.Store, store), rank, world_size, f"roll/{attempt}", str(rank))
    except (RuntimeError, dist.DistStoreError):  # waited TIMEOUT: the row says so
        pass
    return {"rank": rank, "name": name, "posts": len(posts), "calls": dict(store.calls), "start": started,
            "end": time.time()}  # fmt: skip


# (way, attempt number, shuffled): each way starts once, then again on the same store as after a restart
ROUNDS = [(way, number, number == 2) for way in WAYS for number in (1, 2)]


def _process(port: int, ranks: list[int], world_size: int, connected: Any, results: Any) -> None:
    """`ranks`' threads, each a connection to the store made once (a loopback connection without a resolver can
    wait seconds for its host name): every round of ROUNDS, they start together once every process is ready, each
    after its delay, and the process sends what they found."""
    found: list[dict[str, Any]] = []
    here, ready, done = (threading.Barrier(len(ranks) + 1) for _ in range(3))

    def run(rank: int) -> None:
        connection = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT, wait_for_workers=False)
        here.wait()
        for way, number, shuffled in ROUNDS:
            ready.wait()
            time.sleep(_delays(world_size, number, shuffled).get(rank, 0.0))
            found.append(_rank_starts(way, connection, rank, world_size, number))
            done.wait()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    here.wait()
    for _ in ROUNDS:
        connected.wait()  # every process's ranks are connected and the last round is over everywhere
        ready.wait()
        done.wait()
        results.put(list(found))
        found.clear()
    for thread in threads:
        thread.join()


def _delays(world_size: int, number: int, shuffled: bool) -> dict[int, float]:
    """With `shuffled`, the ranks start in a random order over a second, rank 0 last."""
    if not shuffled:
        return {}
    draw = random.Random(number)
    return {rank: draw.uniform(0, 1.0) for rank in range(1, world_size)} | {0: 1.0}


def summarize(way: str, rows: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """One round's calls and seconds (the calls made until TIMEOUT where some rank did not finish), after checking
    that the ranks that finished took one name and read every post."""
    names = {row["name"] for row in rows if row["name"] is not None}
    assert len(rows) == world_size and len(names) <= 1, f"{way}: the ranks took {len(names)} names"
    finished = [row for row in rows if row["name"] is not None and row["posts"] == world_size]
    totals = {row["rank"]: sum(row["calls"].values()) for row in rows}
    return {
        "name": names.pop() if names else None,
        "unfinished": world_size - len(finished),
        "rank 0 calls": totals[0],
        "most calls of another rank": max(total for rank, total in totals.items() if rank),
        "all calls": sum(totals.values()),
        "seconds": max(row["end"] for row in rows) - min(row["start"] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.bench.startup_store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks, each a connection of its own")
    parser.add_argument("--processes", type=int, default=4, help="processes the other ranks' threads are dealt to")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # each loopback client warns that it has no host name
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
    print(f"{args.ranks} ranks: rank 0 in a process, the others' threads in {args.processes}; one TCPStore on "
          f"loopback (libuv: {getattr(server, 'libuvBackend', '?')})", flush=True)  # fmt: skip
    header = f"{'way':<10}{'attempt':<22}{'rank 0 calls':>14}{'most of another':>17}{'all calls':>11}{'seconds':>9}"
    print(header, flush=True)
    context = multiprocessing.get_context("spawn")
    results, connected = context.Queue(), context.Barrier(args.processes + 1)
    # rank 0 in a process of its own, as on a cluster: its loop does not wait on the others' threads for Python
    dealt = [[0], *(list(range(first, args.ranks, args.processes)) for first in range(1, args.processes + 1))]
    workers = [
        context.Process(target=_process, args=(server.port, ranks, args.ranks, connected, results)) for ranks in dealt
    ]
    for worker in workers:
        worker.start()
    measured: dict[tuple[str, int], dict[str, Any]] = {}
    labels = {1: "start", 2: "restart, rank 0 last"}
    for way, number, _ in ROUNDS:
        rows = [row for _ in workers for row in results.get(timeout=2 * TIMEOUT.total_seconds())]
        row = measured[way, number] = summarize(way, rows, args.ranks)
        unfinished = f"  {row['unfinished']} ranks unfinished after {TIMEOUT.seconds} s" if row["unfinished"] else ""
        print(f"{way:<10}{labels[number]:<22}{row['rank 0 calls']:>14,}{row['most calls of another rank']:>17,}"
              f"{row['all calls']:>11,}{row['seconds']:>9.2f}{unfinished}", flush=True)  # fmt: skip
    for worker in workers:
        worker.join()
    for way in WAYS:
        first, again = measured[way, 1]["name"], measured[way, 2]["name"]
        assert first is None or first != again, f"{way}: the restart took the first attempt's name"
    for number, label in labels.items():
        ours, theirs = measured["llmtrain", number], measured["polling", number]
        assert not ours["unfinished"], f"llmtrain's {label} did not finish"
        bound = "at least " if theirs["unfinished"] else ""
        print(f"{label}: {bound}{theirs['all calls'] / ours['all calls']:.1f}x fewer store calls, {bound}"
              f"{theirs['seconds'] / ours['seconds']:.1f}x the speed of polling")  # fmt: skip


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
