"""The worker's process title, so that ``ps`` and ``top`` say which model a worker serves.

A forked worker would otherwise show its template's command line, and every worker of every
model would look alike. Two things are set:

- the command line (``ps -f``, ``ps aux``, ``top`` with ``c``): ``setproctitle`` when the model's
  environment has it; otherwise the argv area the kernel reports (``/proc/self/stat`` fields
  ``arg_start`` and ``arg_end``) is overwritten in place, never past its end, so the title is cut
  to the length of the original command line;
- the command name (``ps -e``, ``top``; 15 bytes): written to ``/proc/self/comm``.

Linux only; elsewhere, or when anything looks unexpected, the title stays as it was: a title is
never worth a failed worker. Stdlib only (runs in the model's environment).
"""

from __future__ import annotations

import importlib

COMM_BYTES = 15  # TASK_COMM_LEN less its NUL


def set_title(title: str, name: str) -> None:
    """Show ``title`` as the command line and ``name`` (cut to 15 bytes) as the command name."""
    if not _with_setproctitle(title):
        _overwrite_argv(title)
    _set_comm(name)  # after setproctitle, which sets the name to the title's first 15 bytes


def _with_setproctitle(title: str) -> bool:
    try:
        module = importlib.import_module("setproctitle")
        module.setproctitle(title)
    except Exception:  # absent or broken, this optional module must not stop the worker
        return False
    return True


def _overwrite_argv(title: str) -> bool:
    """Write ``title`` over the process's original argv strings, NUL-padded to their length."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        # after the command name come fields 3 onwards: arg_start is field 48, arg_end 49
        start, end = int(fields[45]), int(fields[46])
        with open("/proc/self/cmdline", "rb") as f:
            current = f.read()
    except (OSError, ValueError, IndexError):
        return False
    import ctypes  # here: a worker whose environment has setproctitle never loads it

    size = end - start
    # the area must hold exactly what the kernel shows as our command line: then it is ours
    if start <= 0 or size <= 1 or ctypes.string_at(start, size) != current:
        return False
    data = title.encode("utf-8", "replace")[: size - 1]
    ctypes.memmove(start, data.ljust(size, b"\0"), size)
    return True


def _set_comm(name: str) -> bool:
    data = name.encode("utf-8", "replace")[:COMM_BYTES]
    while data:
        try:  # a cut through a multi-byte character: leave it out
            data.decode("utf-8")
            break
        except UnicodeDecodeError:
            data = data[:-1]
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(data)
    except OSError:
        return False
    return True
