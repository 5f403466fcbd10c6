"""`cpu.run` (api/cpu.py): a job runs in the one worker thread, off the event loop, and its result or
exception comes back to the caller; a caller that stops waiting leaves the worker serving the next jobs."""

import asyncio
import threading

import pytest

from asyncrl.inference.api import cpu


def test_a_job_runs_in_one_worker_thread_and_returns_its_result():
    async def main():
        return await asyncio.gather(*[cpu.run(lambda i=i: (i, threading.get_ident())) for i in range(20)])

    results = asyncio.run(main())
    assert [i for i, _ in results] == list(range(20))
    threads = {t for _, t in results}
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_jobs_exception_reaches_its_caller():
    def fail(message):
        raise ValueError(message)

    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(cpu.run(fail, "bad prompt"))


def test_a_cancelled_caller_does_not_stop_the_worker():
    started, release = threading.Event(), threading.Event()

    def blocking():
        started.set()
        release.wait(10)
        return "late"

    async def main():
        first = asyncio.ensure_future(cpu.run(blocking))
        await asyncio.to_thread(started.wait, 10)
        skipped = asyncio.ensure_future(cpu.run(lambda: "never awaited"))
        await asyncio.sleep(0)
        first.cancel()
        skipped.cancel()
        release.set()
        return await cpu.run(lambda: "next")

    assert asyncio.run(main()) == "next"


def test_jobs_of_a_closed_loop_do_not_stop_the_worker():
    started, release = threading.Event(), threading.Event()

    def blocking():
        started.set()
        release.wait(10)

    async def abandon():
        asyncio.ensure_future(cpu.run(blocking))
        await asyncio.to_thread(started.wait, 10)

    asyncio.run(abandon())  # closes its loop with the job still running
    release.set()
    assert asyncio.run(cpu.run(lambda: 7)) == 7
