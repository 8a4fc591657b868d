"""Confine this worker before its handler is imported: Landlock rules for files and TCP ports,
``no_new_privs``, resource limits and, when the server asks, an unprivileged user.

An archive is code: without this, a worker reaches everything the server can (its key file,
other models' folders, the management port). The server decides what a model may reach (its
folder, its scratch folder, what its model config grants: ``server/workers/sandbox.py``) and
sends it in INIT's ``sandbox``; this module adds what the interpreter itself needs (its prefix,
``sys.path``, system libraries) and applies the lot. Landlock applies to the calling thread and
the threads and processes it starts afterwards, so :func:`apply` runs before the worker starts
any thread. Stdlib only; Linux only (elsewhere it reports why nothing was applied).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from errno import EACCES, EPERM

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # same on every arch
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_DUMPABLE = 4

# filesystem rights (include/uapi/linux/landlock.h)
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_ABI1_FS = (1 << 13) - 1  # execute .. make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_DEVICE = _READ_FILE | _WRITE_FILE | _IOCTL_DEV
_NET_BIND, _NET_CONNECT = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1

# What any Python with its C libraries reads: system libraries, locale, time zones, CA
# certificates, /sys (CPU and GPU topology), besides its own prefix and sys.path.
SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/sys", "/opt/conda",
               "/dev/shm")  # fmt: skip
# Of /proc, the worker's own process (``self`` is resolved when the rule is made) and the
# system-wide files libraries read (CPU counts, memory, the NVIDIA driver's version); never
# other processes' folders, whose ``environ`` Landlock's ptrace rules do not cover.
PROC_READ = ("/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/loadavg",
             "/proc/uptime", "/proc/version", "/proc/sys", "/proc/driver", "/proc/devices",
             "/proc/filesystems", "/proc/pressure", "/proc/swaps", "/proc/cgroups")  # fmt: skip
# Character devices every process may use; GPU device files come from the server.
SYSTEM_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
                  "/dev/tty")  # fmt: skip


# What Landlock lets this process reach, once apply() confined it: {"read": [...], "write":
# [...], "uid": n or None}; refusal_hint() reads it. Empty: not confined.
_confined: dict = {}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when there is none (not Linux, too old, or off)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        abi = _libc().syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                              ctypes.c_uint32(_CREATE_RULESET_VERSION))  # fmt: skip
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def _handled_fs(abi: int) -> int:
    rights = _ABI1_FS
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    if abi >= 5:
        rights |= _IOCTL_DEV
    return rights


def interpreter_paths() -> list:
    """What this interpreter reads its modules from: its prefixes and every sys.path entry
    (a .pth file may add folders outside the environment)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}  # fmt: skip
    paths.update(p for p in sys.path if p and os.path.isabs(p))
    paths.add(os.path.dirname(os.path.abspath(__file__)))  # this package, wherever it lies
    return sorted(paths)


def _fail(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


def _add_path(libc: ctypes.CDLL, ruleset: int, path: str, rights: int) -> bool:
    """One path-beneath rule; False when ``path`` does not exist (nothing to allow)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS  # a rule on a file may hold only rights files have
        rule = _PathBeneath(rights, fd)
        if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0) < 0:
            raise _fail(f"landlock rule for {path}")
    finally:
        os.close(fd)
    return True


def _add_port(libc: ctypes.CDLL, ruleset: int, port: int, rights: int) -> None:
    rule = _NetPort(rights, port)
    if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_NET_PORT, ctypes.byref(rule), 0) < 0:
        raise _fail(f"landlock rule for TCP port {port}")


def _add_port_range(libc: ctypes.CDLL, ruleset: int, low: int, high: int, rights: int) -> None:
    """One rule per port (Landlock has no ranges): ~28,000 for the ephemeral range, ~0.2 s."""
    rule = _NetPort(rights, 0)
    ref = ctypes.byref(rule)
    call = libc.syscall
    for port in range(low, high + 1):
        rule.port = port
        if call(_SYS_ADD_RULE, ruleset, _RULE_NET_PORT, ref, 0) < 0:
            raise _fail(f"landlock rule for TCP port {port}")


def _set_limits(limits: dict) -> list:
    """Lower the soft and hard limits named (``nofile``, ``nproc``, ``core``); never raise one."""
    applied = []
    for name, value in sorted(limits.items()):
        which = getattr(resource, "RLIMIT_" + name.upper(), None)
        if which is None or type(value) is not int:
            continue
        soft, hard = resource.getrlimit(which)
        new_hard = value if hard == resource.RLIM_INFINITY else min(hard, value)
        resource.setrlimit(which, (min(new_hard, soft) if soft != resource.RLIM_INFINITY
                                   else new_hard, new_hard))  # fmt: skip
        applied.append(f"{name}={new_hard}")
    return applied


def become(user: dict) -> bool:
    """Switch to the model's own user (``{"uid", "gid", "groups"}``, the server's choice) when
    running as root; False when there is nothing to switch (not root, or no user given). Groups
    first, the uid last: once it is dropped, nothing else can be changed."""
    uid = user.get("uid") if isinstance(user, dict) else None
    if type(uid) is not int or os.getuid() != 0:
        return False
    os.setgroups([g for g in user.get("groups", []) if type(g) is int])
    os.setgid(user.get("gid", uid))
    os.setuid(uid)
    # Leaving root made the process undumpable, which gives its /proc files to root: the
    # worker could not name itself for ps (/proc/self/comm). Its own uid is its model's alone,
    # so only the model's own processes (and root) gain access; core dumps stay off (limits).
    _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    return True


def _landlock(libc: ctypes.CDLL, abi: int, policy: dict) -> dict:
    handled_fs = _handled_fs(abi)
    attr = _RulesetAttr(handled_fs, 0, 0)
    if abi >= 4:
        attr.net = _NET_BIND | _NET_CONNECT
    peers = [r for r in policy.get("peer_ports", []) if isinstance(r, list) and len(r) == 2]
    if abi >= 6:
        # a parallel model's ranks are each in a domain of their own: NCCL's ranks reach one
        # another through abstract Unix sockets, which the scope would refuse
        attr.scoped = _SCOPE_SIGNAL if peers else _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    granted: dict = {"read": [], "write": []}
    try:
        for path in [*SYSTEM_READ, *PROC_READ, *interpreter_paths(), *policy.get("read", [])]:
            if _add_path(libc, ruleset, path, _READ):
                granted["read"].append(path)
        for path in policy.get("write", []):
            if _add_path(libc, ruleset, path, handled_fs):
                granted["write"].append(path)
        _add_path(libc, ruleset, "/dev/shm", handled_fs)  # torch shares tensors through it
        # a kernel before Landlock ABI 5 has no ioctl right, and refuses a rule that names one
        for path in [*SYSTEM_DEVICES, *policy.get("devices", [])]:
            _add_path(libc, ruleset, path, _DEVICE & handled_fs)
        if policy.get("devices"):
            # CUDA's initialisation names the threads it starts (opens /proc/self/task/<tid>/comm
            # to write, truncating) and fails with error 304 when it cannot. "self" is this
            # worker, resolved now: its own threads only, not the rest of /proc.
            _add_path(libc, ruleset, "/proc/self", (_READ | _WRITE_FILE | _TRUNCATE) & handled_fs)
        if abi >= 4:
            for port in policy.get("connect", []):
                _add_port(libc, ruleset, port, _NET_CONNECT)
            for port in policy.get("bind", []):
                _add_port(libc, ruleset, port, _NET_BIND)
            if peers:
                _add_port(libc, ruleset, 0, _NET_BIND)  # gloo listens where the kernel says
                for low, high in peers:
                    _add_port_range(libc, ruleset, low, high, _NET_BIND | _NET_CONNECT)
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) < 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(ruleset)
    return granted


def apply(policy: dict) -> dict:
    """Confine this process as ``policy`` (INIT's ``sandbox``) says; what was applied, for the
    server to show: ``{"applied": [...], "landlock_abi": n}`` or ``{"applied": [], "reason": ...}``.
    A step that fails stops the worker (``OSError``): a model meant to be confined must not run
    unconfined because one step went wrong; what cannot be applied at all is a ``reason``."""
    if not sys.platform.startswith("linux"):
        return {"applied": [], "reason": f"no confinement on {sys.platform}"}
    applied = _set_limits(policy.get("limits", {}))
    tmp = policy.get("tmpdir")
    if tmp:
        for name in ("TMPDIR", "TEMP", "TMP"):
            os.environ[name] = tmp
        if "tempfile" in sys.modules:  # the template may have asked it already
            sys.modules["tempfile"].tempdir = None
    libc = _libc()
    user = policy.get("user")
    if isinstance(user, dict) and type(user.get("uid")) is int:
        become(user)  # a forked worker switched right after the fork; an exec'd one does now
        if os.getuid() != user["uid"]:
            raise OSError(1, f"cannot run as uid {user['uid']}: running as uid {os.getuid()}")
        applied.append(f"uid={user['uid']}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_NO_NEW_PRIVS)")
    applied.append("no_new_privs")
    report: dict = {"applied": applied}
    abi = landlock_abi()
    if abi <= 0:
        report["reason"] = "the kernel offers no Landlock (too old, or not enabled)"
        return report
    granted = _landlock(libc, abi, policy)
    report.update(granted, landlock_abi=abi)
    _confined.update(read=granted["read"], write=[*granted["write"], "/dev/shm"],
                     uid=user.get("uid") if isinstance(user, dict) else None)  # fmt: skip
    applied.append("landlock-files")
    if abi >= 4:
        applied.append("landlock-tcp")
        report["connect"] = list(policy.get("connect", []))
        report["bind"] = list(policy.get("bind", []))
        if policy.get("peer_ports"):
            report["peer_ports"] = policy["peer_ports"]
    if abi >= 6:
        applied.append("landlock-scope")
    return report


def _beneath(path: str, roots: list) -> bool:
    for root in roots:
        real = os.path.realpath(root)
        if path == real or path.startswith(real.rstrip("/") + "/"):
            return True
    return False


def _refused_file(exc: BaseException | None) -> str | None:
    """The first ``PermissionError`` naming a file in ``exc``'s chain (a library may raise its
    own error from the OS's); None when there is none."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            name = exc.filename
            refused = exc.errno in (EACCES, EPERM)
            if refused and name and isinstance(name, (str, bytes, os.PathLike)):
                return os.fsdecode(name)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def refusal_hint(exc: BaseException) -> str | None:
    """Why this confined worker was refused the file ``exc`` names, and what grants it; None
    when ``exc`` is no such refusal or the worker is not confined. Landlock answers EACCES as
    the file's permissions do, so this tells them apart: ``access(2)`` sees only the
    permissions, and the granted paths are known."""
    if not _confined:
        return None
    name = _refused_file(exc)
    if name is None:
        return None
    path = os.path.realpath(name)
    writable = _beneath(path, _confined["write"])
    if not writable and not _beneath(path, _confined["read"]):
        return (
            f"the sandbox keeps this worker out of {path}; for models to read it, grant it"
            " with the server setting sandbox_read_paths (every model) or the model config's"
            " sandbox.readPaths (this model; sandbox.writePaths to write)"
        )
    try:
        os.stat(path)  # Landlock leaves stat(2) alone: a refusal here is a folder's mode
        exists = True
    except FileNotFoundError:
        exists = False
    except OSError:
        return _permissions_hint(path)
    if not writable and (not exists or os.access(path, os.R_OK)):
        return (
            f"the sandbox lets this worker read {path} but not write it; grant writing with the"
            " model config's sandbox.writePaths (a model cache such as TORCH_HOME or"
            " HF_HUB_CACHE is read-only)"
        )
    target = path if exists else os.path.dirname(path)
    if os.access(target, os.W_OK if writable else os.R_OK):
        return None  # allowed by both: the refusal came from elsewhere
    return _permissions_hint(target)


def _permissions_hint(path: str) -> str | None:
    """A granted path the model's own uid may not open by its modes; None when the worker
    runs as the server's user (the file's permissions, as without the sandbox)."""
    uid = _confined.get("uid")
    if uid is None:
        return None
    return (
        f"this worker runs as uid {uid}, which the permissions of {path} do not let in (the"
        " sandbox grants it): give that uid access (chmod, a group, an ACL) or set"
        " sandbox_uid_range: off"
    )
