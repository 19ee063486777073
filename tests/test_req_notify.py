"""Update delivery (issue 42): ``Req.notify`` and the front end's ``stream`` / ``drain`` /
``stream_many`` on requests driven by hand (no engine): coalescing to the newest output, the
final chunk never lost, no wake-up of a drain before the finish, no task per request, and an
abandoned consumer aborting what is unfinished."""

from __future__ import annotations

import asyncio

from core.engine.frontend import RequestFrontEnd
from core.engine.request import Req
from core.engine.sampling_params import SamplingParams


class Front(RequestFrontEnd):
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def req(rid: str) -> Req:
    return Req(rid, [5, 6, 7], SamplingParams(max_new_tokens=8))


def step(r: Req, tok: int, finish: bool = False) -> None:
    r.output_ids.append(tok)
    if finish:
        r.finish_reason = {"type": "length", "length": len(r.output_ids)}
    r.notify()


def test_notify_without_a_consumer_is_harmless() -> None:
    r = req("a")
    step(r, 1)
    step(r, 2, finish=True)
    assert r.updated


def test_stream_coalesces_to_the_newest_output_and_keeps_the_final_one() -> None:
    async def main():
        fe, r = Front(), req("a")
        agen = fe.stream(r)
        step(r, 1)
        step(r, 2)  # the consumer fell behind: one chunk, the newest
        first = await agen.__anext__()
        assert first["output_ids"] == [1, 2]
        nxt = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        assert not nxt.done()  # nothing new: it waits
        step(r, 3)
        step(r, 4, finish=True)
        last = await nxt
        assert last["output_ids"] == [1, 2, 3, 4] and last["meta_info"]["finish_reason"]["type"] == "length"
        assert [c async for c in agen] == []
        assert fe.aborted == []

    asyncio.run(main())


def test_stream_yields_a_finish_that_came_before_the_consumer() -> None:
    async def main():
        fe, r = Front(), req("a")
        step(r, 1, finish=True)
        chunks = [c async for c in fe.stream(r)]
        assert [c["output_ids"] for c in chunks] == [[1]]

    asyncio.run(main())


def test_drain_wakes_only_at_the_finish() -> None:
    async def main():
        fe, r = Front(), req("a")
        t = asyncio.ensure_future(fe.drain(r))
        await asyncio.sleep(0)
        for i in range(5):
            step(r, i)
            assert r._done is not None and not r._done.done()  # no per-step resolution
            await asyncio.sleep(0)
            assert not t.done()
        step(r, 9, finish=True)
        await asyncio.wait_for(t, 1)
        assert fe.aborted == []
        await fe.drain(r)  # already finished: returns at once

    asyncio.run(main())


def test_cancelled_drain_aborts_the_request() -> None:
    async def main():
        fe, r = Front(), req("a")
        t = asyncio.ensure_future(fe.drain(r))
        await asyncio.sleep(0)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        assert fe.aborted == ["a"]

    asyncio.run(main())


def test_stream_many_feeds_one_queue_without_tasks_and_coalesces() -> None:
    async def main():
        fe, a, b, c = Front(), req("a"), req("b"), req("c")
        agen = fe.stream_many([a, b, c])
        nxt = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)  # the consumer waits
        tasks = len(asyncio.all_tasks())
        step(b, 1)
        step(a, 1)
        step(b, 2)  # b again before the consumer looked: still one chunk, the newest, in first-notified order
        got = [await nxt, await agen.__anext__()]
        assert [(i, o["output_ids"]) for i, o in got] == [(1, [1, 2]), (0, [1])]
        assert len(asyncio.all_tasks()) <= tasks  # no task per request (only this test's own, now done)
        step(c, 1, finish=True)
        step(a, 2, finish=True)
        step(b, 3, finish=True)
        rest = [(i, o["output_ids"]) async for i, o in agen]
        assert rest == [(2, [1]), (0, [1, 2]), (1, [1, 2, 3])]
        assert fe.aborted == [] and all(r.watcher is None for r in (a, b, c))

    asyncio.run(main())


def test_closing_stream_many_early_aborts_the_unfinished() -> None:
    async def main():
        fe, a, b = Front(), req("a"), req("b")
        agen = fe.stream_many([a, b])
        step(a, 1, finish=True)
        assert (await agen.__anext__())[0] == 0
        await agen.aclose()
        assert fe.aborted == ["b"] and b.watcher is None

    asyncio.run(main())


def test_abandoned_stream_aborts_the_request() -> None:
    async def main():
        fe, r = Front(), req("a")
        agen = fe.stream(r)
        step(r, 1)
        await agen.__anext__()
        await agen.aclose()
        assert fe.aborted == ["a"]

    asyncio.run(main())
