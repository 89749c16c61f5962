"""Online updates beside serving: the strategy learns in a worker thread while the next round
is served, so an update costs the server only the time it waits for it.

In a deployment the update runs on compute the server does not use (another core, another
device, the idle share of a GPU). Here the worker is a thread of the same process: with
``threads: 1`` (the config's torch threads) the server's ops run on one core and the update's on
another, and the server pays only when the update of round r-1 is still running at the end of
round r. The price is staleness: round r+1 is served by the drafter learned from rounds up to
r-1, one round later than with updates in series. The served drafter is a snapshot taken while
the worker is idle, so serving never reads weights being written.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lightning_spec.online.strategies import OnlineStrategy

__all__ = ["BesideUpdater"]


class BesideUpdater:
    """One update at a time in a worker thread; `served` is the drafter the server reads."""

    def __init__(self, strategy: OnlineStrategy) -> None:
        self.strategy = strategy
        self._threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="online-update")
        self._future: Future[dict[str, Any]] | None = None
        self.served = self._snapshot()

    def _snapshot(self) -> Any:
        drafter = copy.deepcopy(self.strategy.drafter)
        drafter.eval()
        return drafter

    def _update(self, generations: list[Any]) -> dict[str, Any]:
        torch.set_num_threads(self._threads)  # the worker's ops on their own share of cores
        return self.strategy.update(generations)

    def launch(self, generations: Sequence[Any]) -> None:
        """Start learning from `generations` (the previous update must have been settled)."""
        if self._future is not None:
            raise RuntimeError("settle() the running update before launching another")
        self._future = self._pool.submit(self._update, list(generations))

    def settle(self) -> tuple[float, dict[str, Any]]:
        """Wait for the running update (if any) and serve its result from now on: (seconds
        the server waited, the update's report; empty when none was running)."""
        if self._future is None:
            return 0.0, {}
        tic = time.perf_counter()
        report = self._future.result()  # an update's exception surfaces here, in the server
        waited = time.perf_counter() - tic
        self._future = None
        self.served = self._snapshot()
        return waited, report

    def close(self) -> None:
        """The end of the stream: wait for the running update, stop the worker."""
        self.settle()
        self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """The server failed: let the running update finish (its state is not checkpointed;
        a resumed run launches it again) without raising its errors over the server's."""
        self._pool.shutdown(wait=True)
        self._future = None
