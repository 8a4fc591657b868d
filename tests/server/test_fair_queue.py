"""The fair queue's order, in process (server/models/fair.py): weights, a tenant alone, a quiet
tenant arriving, requeued jobs, the bound, cancelled callers. The served figures on a real
server are tests/server/test_tenants.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from mserve_worker.protocol import RequestItem
from server.models.batching import Job, QueueFull
from server.models.fair import CONTENDED_FOR, FairJobQueue, FairLine
from server.tenants import Tenant, TenantSpec


def run(body: Callable[[], None]) -> None:
    async def main() -> None:
        body()

    asyncio.run(main())


def job(queue: FairJobQueue, tenant: Tenant | None, rid: str) -> Job:
    made = Job(RequestItem(request_id=rid, content_type="", headers=[], body=b""),
               queue.new_future())  # fmt: skip
    made.tenant = tenant
    return made


def order(queue: FairJobQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        popped = queue.pop()
        assert popped is not None
        out.append(popped.item.request_id)
    return out


def test_weights_alone_and_a_quiet_tenant() -> None:
    def body() -> None:
        heavy, light = Tenant(TenantSpec("heavy", weight=3)), Tenant(TenantSpec("light"))
        queue = FairJobQueue(100)
        for i in range(12):
            queue.put(job(queue, heavy, f"h{i}"))
            queue.put(job(queue, light, f"l{i}"))
        taken = order(queue, 16)
        assert sum(t.startswith("h") for t in taken) == 12  # 3 of heavy's per light's
        assert queue.served == {"heavy": 12, "light": 4}
        assert queue.contended()  # workers are sent fewer batches ahead
        # heavy alone: everything it has, in order; no contention
        queue = FairJobQueue(100)
        for i in range(5):
            queue.put(job(queue, heavy, f"h{i}"))
        assert order(queue, 5) == ["h0", "h1", "h2", "h3", "h4"]
        assert not queue.contended()
        # a quiet tenant arriving behind a backlog goes next, not last
        for i in range(20):
            queue.put(job(queue, heavy, f"b{i}"))
        order(queue, 2)
        queue.put(job(queue, light, "quiet"))
        assert "quiet" in order(queue, 2)

    run(body)


def test_requeue_pop_matching_bound_and_gone_callers() -> None:
    def body() -> None:
        a, b = Tenant(TenantSpec("a")), Tenant(TenantSpec("b"))
        queue = FairJobQueue(4)
        jobs = [job(queue, a, "a0"), job(queue, b, "b0"), job(queue, a, "a1")]
        for j in jobs:
            queue.put(j)
        first = [queue.pop(), queue.pop()]
        queue.requeue([j for j in first if j is not None])  # back at the head, same tags
        assert order(queue, 3) == ["a0", "b0", "a1"]
        assert queue.served == {"a": 2, "b": 1}  # the requeued ones counted once
        for j in (job(queue, a, "x"), job(queue, b, "y"), job(queue, None, "z")):
            queue.put(j)
        matched = queue.pop_matching(lambda j: j.item.request_id == "y")
        assert matched is not None and matched.item.request_id == "y"
        assert len(queue) == 2
        gone = job(queue, a, "gone")
        queue.put(gone)
        queue.put(job(queue, b, "w"))
        with pytest.raises(QueueFull):
            queue.put(job(queue, b, "over"))
        gone.future.cancel()  # its caller left: at the bound its place is freed
        queue.put(job(queue, b, "fits"))
        assert queue.fail_all(RuntimeError("stop")) == 4
        assert len(queue) == 0 and queue.pop() is None

    run(body)


def test_contention_and_a_lone_tenant_whose_queue_empties() -> None:
    """Workers are sent fewer batches ahead while tenants contend (server/models/pump.py reads
    ``contended``); a tenant alone, its queue emptied after each request (the common case the
    put/pop fast path is for), is served in order and does not contend."""

    def body() -> None:
        heavy, light, quiet = (Tenant(TenantSpec(n)) for n in ("heavy", "light", "quiet"))
        queue = FairJobQueue(1000)
        for i in range(200):
            queue.put(job(queue, heavy, f"h{i}"))
            queue.put(job(queue, light, f"l{i}"))
        order(queue, CONTENDED_FOR + 1)
        assert queue.contended()
        queue.put(job(queue, quiet, "q"))
        assert "q" in order(queue, 2)  # a newcomer is taken next
        alone = FairJobQueue(10)
        for i in range(CONTENDED_FOR + 1):
            alone.put(job(alone, heavy, f"a{i}"))
            popped = alone.pop()
            assert popped is not None and popped.item.request_id == f"a{i}"
        assert not alone.contended()
        assert len(alone) == 0 and alone.served == {"heavy": CONTENDED_FOR + 1}

    run(body)


def test_the_line_for_a_seat_goes_by_weight_and_without_tenants_by_arrival() -> None:
    """FairLine: sequences past maxNumSequence (server/models/sequences.py) waiting for a seat."""
    heavy, light = Tenant(TenantSpec("heavy", weight=3)), Tenant(TenantSpec("light"))

    def seats(line: FairLine[str], n: int) -> list[str]:
        out = []
        for _ in range(n):
            name = line.pop()
            line.seated(tags[name])
            out.append(name)
        return out

    line: FairLine[str] = FairLine()
    tags = {f"s{i}": line.tag(None) for i in range(4)}  # no tenants: arrival order
    for name in ("s0", "s1", "s2", "s3"):
        line.put(name, tags[name])
    line.remove("s1")  # its client left
    assert seats(line, 3) == ["s0", "s2", "s3"] and not line
    line = FairLine()
    tags = {f"h{i}": line.tag(heavy) for i in range(8)}
    tags.update({f"l{i}": line.tag(light) for i in range(2)})  # they come last
    for name in tags:
        line.put(name, tags[name])
    assert seats(line, 6) == ["h0", "l0", "h1", "h2", "h3", "l1"]  # 3 of heavy's per light's
    # a sequence back in line (its worker gone) keeps the tag it had: it goes first
    line.put("h1", tags["h1"])
    assert seats(line, 1) == ["h1"]
    # a tenant quiet so far starts at "now": next, not behind heavy's backlog
    tags["quiet"] = line.tag(Tenant(TenantSpec("quiet")))
    line.put("quiet", tags["quiet"])
    assert seats(line, 2) == ["quiet", "h4"]


def test_jobs_sent_ahead_are_the_idle_tenants_and_never_before_their_turn() -> None:
    """pop_ahead (the batch a pump sends ahead of those its worker holds): only tenants with
    nothing in flight there, at most the batch size, and none whose fair turn comes after the
    busy tenants' next job; a newcomer beside others' jobs offers the pumps the chance."""

    def body() -> None:
        noisy, quiet, other = (Tenant(TenantSpec(n)) for n in ("noisy", "quiet", "other"))
        queue = FairJobQueue(100)
        offered: list[int] = []
        queue.ahead_takers.append(lambda: offered.append(len(queue)) is not None and False)
        for i in range(6):
            queue.put(job(queue, noisy, f"n{i}"))
        order(queue, 4)  # four of noisy's went to the worker; n4, n5 wait
        assert offered == []  # one tenant: nobody to send ahead
        for name in ("q0", "q1", "q2"):
            queue.put(job(queue, quiet, name))
        queue.put(job(queue, other, "o0"))
        assert offered == [3, 6]  # quiet's lane and other's started to wait beside noisy's
        # noisy is busy (in flight): never sent ahead; quiet's and other's, by tag, up to 2
        taken = [j.item.request_id for j in queue.pop_ahead({"noisy"}, 2)]
        assert taken == ["q0", "o0"]
        # q1's turn ties with noisy's next (n4); q2's comes after it: it waits its turn
        assert [j.item.request_id for j in queue.pop_ahead({"noisy"}, 8)] == ["q1"]
        assert queue.pop_ahead({"noisy"}, 8) == []
        assert order(queue, 3) == ["n4", "n5", "q2"]
        assert queue.served == {"noisy": 6, "quiet": 3, "other": 1}

    run(body)
