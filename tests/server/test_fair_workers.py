"""Worker threads tenants share in turn (server/guard/fair_workers.py): a queue of one tenant's jobs never holds another's
back by more than the jobs already running; a job not started when its caller leaves is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from kvfork.server.guard.fair_workers import FairWorkers


def test_another_tenant_goes_next_however_many_jobs_one_has_queued():
    workers = FairWorkers(1, "test-fair")
    gate, order = threading.Event(), []

    def job(name: str) -> str:
        gate.wait(30)
        order.append(name)
        return name

    try:
        first = workers.submit("hostile", job, "h0")
        queued = [workers.submit("hostile", job, f"h{i}") for i in range(1, 6)]
        innocent = workers.submit("innocent", job, "i0")
        gate.set()
        assert innocent.result(30) == "i0"
        for future in [first, *queued]:
            future.result(30)
        assert order.index("i0") <= 2  # behind the running job and at most one queued before it arrived
    finally:
        workers.close()


def test_a_tenant_runs_one_job_at_a_time_so_another_finds_a_thread():
    workers = FairWorkers(2, "test-fair")
    gate, running = threading.Event(), []

    def job(name: str) -> str:
        running.append(name)
        gate.wait(30)
        return name

    try:
        hostile = [workers.submit("hostile", job, f"h{i}") for i in range(4)]
        innocent = workers.submit("innocent", job, "i0")
        deadline = threading.Event()
        while "i0" not in running and not deadline.wait(0.01):
            pass
        assert running[:2] in (["h0", "i0"], ["i0", "h0"])  # the second thread went to the other tenant
        gate.set()
        assert innocent.result(30) == "i0" and [f.result(30) for f in hostile] == ["h0", "h1", "h2", "h3"]
    finally:
        workers.close()


async def test_a_job_whose_caller_left_before_it_started_is_dropped():
    workers = FairWorkers(1, "test-fair")
    gate, ran = threading.Event(), []

    def job(name: str) -> None:
        gate.wait(30)
        ran.append(name)

    try:
        blocker = asyncio.ensure_future(workers.run("a", job, "first"))
        gone = asyncio.ensure_future(workers.run("a", job, "gone"))
        await asyncio.sleep(0.05)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone  # its job's cancellation has reached the worker's queue
        gate.set()
        await blocker
        await asyncio.sleep(0.05)
        assert ran == ["first"]
    finally:
        workers.close()
