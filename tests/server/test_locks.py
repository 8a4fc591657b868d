"""server/locks.py between real processes: a lock another process holds is seen and waited for,
and a holder that dies (SIGKILL) leaves nothing locked."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from server import locks

HOLDER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from server import locks\n"
    "fd = locks.try_hold(Path(sys.argv[1]))\n"
    "print('held' if fd is not None else 'refused', flush=True)\n"
    "time.sleep(60)\n"
)


def _holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_held_by_another_process_is_seen_and_dropped_when_it_dies(tmp_path: Path) -> None:
    path = tmp_path / "mserve.lock"
    assert not locks.held_elsewhere(path)  # no file yet: nobody
    proc = _holder(path)
    try:
        assert locks.held_elsewhere(path)
        assert locks.try_hold(path) is None  # a second holder is refused
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert not locks.held_elsewhere(path)  # the kernel dropped it with the process
    fd = locks.try_hold(path)
    assert fd is not None


def test_exclusive_waits_for_the_holder_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / ".env.lock"
    proc = _holder(path)
    said: list[float] = []
    entered: list[float] = []

    def take() -> None:
        with locks.exclusive(path, lambda: said.append(time.monotonic())):
            entered.append(time.monotonic())

    taker = threading.Thread(target=take)
    taker.start()
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said, "the waiting callback was not called while another process held the lock"
    assert not entered  # still waiting
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    taker.join(10)
    assert entered and entered[0] >= said[0]
    called: list[float] = []
    with locks.exclusive(path, lambda: called.append(0.0)):
        pass
    assert not called  # free: taken at once, nothing said
