"""Micro-batching: concurrent requests with the same decode options share one batched decode.

One dispatcher task owns the queue. It takes the oldest request, waits at most `max_wait_ms` after
that request arrived for others with the same key (up to `max_batch`, or the request's own `limit`:
the server caps each decoder's batches on its own), and runs the batch on a decode worker thread,
so the event loop keeps answering health checks and rejecting overload while the model decodes.
With `workers` threads, up to that many batches decode at once; the next batch is formed only when
a worker is free, so requests that arrive meanwhile queue up and batch together. (On a 2-core CPU,
two workers of one torch thread each served 1.9-2.4x the requests of one worker of two threads:
docs/EXPERIMENTS.md.) Each worker is its own thread, numbered from 0, and a batch goes to the
lowest-numbered free worker: a request that arrives alone always decodes on worker 0, the one the
server lets use every torch thread (server.py, `_share_threads`).

The queue is bounded by admission: `admit()` raises QueueFull at once, with no await, when
`max_queue` requests are already admitted (waiting, or in a batch being decoded, until their
caller is answered). A handler admits first and only then retrieves, renders and submits, so a
refusal costs no work. A request whose caller went away (deadline, cancellation) is removed from the
queue; if every request of a running batch went away, `should_stop()` turns true for its batch
function, which is expected to abandon the decode (server.py does it between forward passes).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded queue is full; the server answers RESOURCE_EXHAUSTED."""


class BatcherClosed(Exception):
    """The batcher was closed before this request ran."""


@dataclass
class Outcome:
    value: Any  # the batch function's result for this request (or an Exception instance)
    queue_ms: float
    decode_ms: float
    batch_size: int


@dataclass
class _Job:
    item: Any
    key: Hashable
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    gone: bool = False  # the caller stopped waiting
    limit: int | None = None  # the most requests its batch may hold (None: the batcher's max_batch)


class Admission:
    """One of the batcher's `max_queue` places, held from admission until released (the handler
    releases it when its caller is answered)."""

    def __init__(self, batcher: "MicroBatcher"):
        self._batcher = batcher
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._batcher._admitted -= 1

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# batch function: (items, key, should_stop) -> one result (or Exception instance) per item, in order
BatchFn = Callable[[list, Hashable, Callable[[], bool]], list]


class MicroBatcher:
    def __init__(self, run_batch: BatchFn, max_batch: int = 8, max_wait_ms: float = 5.0, max_queue: int = 64,
                 workers: int = 1):
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0 or workers < 1:
            raise ValueError(f"need max_batch >= 1, max_queue >= 1, max_wait_ms >= 0, workers >= 1; got "
                             f"{max_batch}, {max_queue}, {max_wait_ms}, {workers}")
        self.run_batch = run_batch
        self.max_batch = int(max_batch)
        self.max_wait = float(max_wait_ms) / 1000.0
        self.max_queue = int(max_queue)
        self._pending: list[_Job] = []  # arrival order, not yet in a batch
        self._wakeup = asyncio.Event()
        # `workers` threads share the one model (inference only: no state changes between calls);
        # one executor each, so a batch can be sent to a chosen worker
        self.workers = int(workers)
        self._worker = threading.local()  # .index on a worker's thread
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"rerank-decode-{i}",
                                              initializer=self._name_worker, initargs=(i,))
                           for i in range(self.workers)]
        self._idle_workers = set(range(self.workers))
        self._free = asyncio.Semaphore(self.workers)  # a worker for the next batch
        self._task: asyncio.Task | None = None
        self._runs: dict[asyncio.Task, list[_Job]] = {}  # the batches being decoded
        self._admitted = 0  # places held (Admission): waiting, decoding, or being prepared by a handler
        self.batches = 0

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def admitted(self) -> int:
        return self._admitted

    def admit(self) -> Admission:
        """A place for one request, or QueueFull at once (no await: the refusal does no work)."""
        if self._task is None or self._task.done():
            raise BatcherClosed("the batcher is not running")
        if self._admitted >= self.max_queue:
            raise QueueFull(f"queue full ({self.max_queue} requests admitted, the decoding batch included); "
                            f"retry later")
        self._admitted += 1
        return Admission(self)

    def _name_worker(self, index: int) -> None:
        self._worker.index = index

    def current_worker(self) -> int | None:
        """The worker number of the calling thread (None off the decode workers)."""
        return getattr(self._worker, "index", None)

    @property
    def decoding_batches(self) -> int:
        """Batches being decoded now (read from the decode threads too: one len() of a dict)."""
        return len(self._runs)

    @property
    def running(self) -> int:
        """Requests in batches being decoded."""
        return sum(len(batch) for batch in self._runs.values())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="micro-batcher")

    async def run_in_worker(self, fn: Callable, *args):
        """Run fn on decode worker 0 (warm-up uses the model there too)."""
        return await asyncio.get_running_loop().run_in_executor(self._executors[0], fn, *args)

    async def submit(self, item: Any, key: Hashable, admission: Admission | None = None,
                     limit: int | None = None) -> Outcome:
        """Queue `item` under `admission` (None: admit it here, and release when answered), wait for
        its batch, which holds at most `limit` requests (None: max_batch; requests with one key have
        one limit). Raises QueueFull immediately when no place is free; cancelling the caller removes
        the item from the queue (or marks it gone if running)."""
        own = admission is None
        if own:
            admission = self.admit()
        elif self._task is None or self._task.done():
            raise BatcherClosed("the batcher is not running")
        try:
            job = _Job(item, key, asyncio.get_running_loop().create_future(), limit=limit)
            self._pending.append(job)
            self._wakeup.set()
            try:
                return await job.future
            except asyncio.CancelledError:
                job.gone = True
                if job in self._pending:
                    self._pending.remove(job)
                raise
        finally:
            if own:
                admission.release()

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._free.acquire()  # released when the batch's run ends
            if not self._pending:  # every waiting caller left while the workers were busy
                self._free.release()
                continue
            head = self._pending[0]
            cap = head.limit or self.max_batch
            # wait for company: until `cap` same-key requests or max_wait after the head arrived
            until = head.enqueued + self.max_wait
            while (sum(j.key == head.key for j in self._pending) < cap
                   and (left := until - time.monotonic()) > 0 and not head.gone):
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = [j for j in self._pending if j.key == head.key and not j.gone][:cap]
            for j in batch:
                self._pending.remove(j)
            if not batch:
                self._free.release()
                continue
            worker = min(self._idle_workers)  # the semaphore guarantees one
            self._idle_workers.remove(worker)
            run = loop.create_task(self._run(loop, batch, worker), name="micro-batch")
            self._runs[run] = batch
            run.add_done_callback(lambda task, worker=worker: self._ran(task, worker))

    def _ran(self, run: asyncio.Task, worker: int) -> None:
        self._runs.pop(run, None)
        self._idle_workers.add(worker)
        self._free.release()

    async def _run(self, loop, batch: list[_Job], worker: int) -> None:
        start = time.monotonic()
        self.batches += 1
        try:
            results = await loop.run_in_executor(self._executors[worker], self.run_batch, [j.item for j in batch],
                                                 batch[0].key, lambda: all(j.gone for j in batch))
            if len(results) != len(batch):
                raise RuntimeError(f"batch function returned {len(results)} results for {len(batch)} requests")
        except Exception as e:  # noqa: BLE001 -- every caller of the batch gets the error
            log.exception("batch of %d failed", len(batch))
            results = [e] * len(batch)
        decode_ms = (time.monotonic() - start) * 1000.0
        for j, r in zip(batch, results):
            if not j.future.done():  # a caller that gave up has a cancelled future
                j.future.set_result(Outcome(r, (start - j.enqueued) * 1000.0, decode_ms, len(batch)))

    async def close(self) -> None:
        """Stop dispatching; queued requests fail with BatcherClosed. A running decode is not waited for."""
        running = [j for batch in self._runs.values() for j in batch]
        for task in [self._task, *self._runs]:
            if task is not None:
                task.cancel()
        for task in [self._task, *self._runs]:
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for j in self._pending + running:
            if not j.future.done():
                j.future.set_exception(BatcherClosed("server shutting down"))
        self._pending.clear()
        self._runs.clear()
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)
