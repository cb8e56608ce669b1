"""Worker threads shared by tenants in turn: one tenant's queue of long jobs never holds another's back.

A job (rendering and tokenizing a long prompt, compiling a grammar) runs off the event loop on a
few threads. With a first-come queue, a tenant that sends twenty long prompts at once would make
another's short one wait for all twenty. Here each tenant has its own queue, the threads take
tenants in turn, and a tenant runs at most one job at a time: another tenant waits at most for the
jobs already running. Each job is bounded by the limits its request was checked against.

A job not yet started when its caller stops waiting (a client gone) is dropped; one that has
started runs to its end, which is why jobs are bounded (server/guard/limits.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Callable


class FairWorkers:
    def __init__(self, threads: int, name: str, start: Callable[[], Any] | None = None):
        """`start()`, when given, runs first on each thread; its result, the thread's own resource (a
        compile process), is each job's first argument, and is closed (`close()`) when the thread ends."""
        self._queues: OrderedDict[str, deque] = OrderedDict()  # tenant -> its jobs; the next tenant first
        self._running: set[str] = set()
        self._ready = threading.Condition()
        self._closed = False
        self._start = start
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the workers are closed")
            self._queues.setdefault(tenant, deque()).append((future, fn, args))
            self._ready.notify()
        return future

    async def run(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker; cancelling the caller drops the job if it has not started."""
        return await asyncio.wrap_future(self.submit(tenant, fn, *args))

    def close(self) -> None:
        """Drop the jobs not started; the threads end after the ones running."""
        with self._ready:
            self._closed = True
            for queue in self._queues.values():
                for future, _, _ in queue:
                    future.cancel()
            self._queues.clear()
            self._ready.notify_all()

    def _next(self) -> tuple[str, Future, Callable, tuple] | None:
        with self._ready:
            while True:
                if self._closed:
                    return None
                tenant = next((t for t in self._queues if t not in self._running), None)
                if tenant is not None:
                    break
                self._ready.wait()
            queue = self._queues.pop(tenant)
            future, fn, args = queue.popleft()
            if queue:
                self._queues[tenant] = queue  # to the back of the line
            self._running.add(tenant)
            return tenant, future, fn, args

    def _serve(self) -> None:
        resource = self._start() if self._start is not None else None
        try:
            self._serve_jobs(resource)
        finally:
            if resource is not None:
                resource.close()

    def _serve_jobs(self, resource: Any) -> None:
        while (job := self._next()) is not None:
            tenant, future, fn, args = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(resource, *args) if self._start is not None else fn(*args)
                    except BaseException as exc:  # the caller gets it
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._ready:
                    self._running.discard(tenant)
                    self._ready.notify_all()
