"""A worker's output pipe has one owner in the server: read to its end, closed exactly once.

Under uvloop, ``connect_read_pipe`` with a file object closed the pipe's number twice (libuv,
then the file object, often from the garbage collector); a descriptor another thread opened in
between was closed under it: a fork from a worker template failed with EBADF that way.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import uvloop

from server.workers.pipe_reader import read_pipe


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def test_the_pipe_is_closed_at_its_end_and_a_descriptor_reusing_its_number_survives() -> None:
    async def main() -> None:
        r, w = os.pipe()
        pipe_inode = _inode(r)
        reader = read_pipe(r)
        os.write(w, b"first line\nsecond")
        os.close(w)
        assert await reader.readline() == b"first line\n"
        assert await reader.read() == b"second"
        assert reader.at_eof()
        assert _inode(r) != pipe_inode  # closed at its end, not left to the collector

        again_r, again_w = os.pipe()  # the lowest free numbers: r's among them
        taken = {fd: _inode(fd) for fd in (again_r, again_w)}
        del reader
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)
        assert {fd: _inode(fd) for fd in taken} == taken
        os.close(again_r)
        os.close(again_w)

    uvloop.run(main())


def test_more_than_the_reader_holds_arrives_whole_while_it_pauses() -> None:
    """A worker printing faster than the server reads waits on its full pipe; nothing is lost."""
    payload = b"".join(b"line %06d of a chatty worker\n" % i for i in range(40_000))  # ~1.2 MB

    async def main() -> bytes:
        r, w = os.pipe()
        reader = read_pipe(r)

        def write() -> None:
            with os.fdopen(w, "wb") as sink:
                sink.write(payload)

        writer = threading.Thread(target=write)
        writer.start()
        await asyncio.sleep(0.2)  # the writer fills the pipe and the reader's buffer
        received = await reader.read()
        writer.join()
        return received

    assert uvloop.run(main()) == payload


def test_threads_opening_files_while_workers_come_and_go_keep_their_descriptors() -> None:
    """The warm tier's threads open and map files while workers' pipes end: none of their
    descriptors is closed under them (before: EBADF in such a thread or in the event loop)."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def opener() -> None:
        while not stop.is_set():
            try:
                fd = os.open("/proc/self/stat", os.O_RDONLY)
                try:
                    for _ in range(10):
                        os.fstat(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                errors.append(exc)

    def collector() -> None:
        while not stop.is_set():
            gc.collect()

    async def main() -> None:
        for _ in range(150):
            r, w = os.pipe()
            reader = read_pipe(r)
            os.write(w, b"ready\n")
            os.close(w)
            while await reader.readline():
                pass

    threads = [threading.Thread(target=opener), threading.Thread(target=collector)]
    for thread in threads:
        thread.start()
    try:
        uvloop.run(main())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
