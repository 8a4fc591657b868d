"""Which imports a model's pickled weights would make when unpickled, found without unpickling.

Unpickling runs whatever callables a pickle names (``posix.system`` among them), so a weights
file is code. picklescan reads each pickle's opcodes (the ``data.pkl`` of a torch zip file,
the pickles of the legacy format, plain pickles, numpy's) and lists the globals it would
import; nothing is imported or called. picklescan rather than fickling: fickling's
``is_likely_safe`` does not open torch zip files, reads only the first pickle of a legacy
torch file (it passed one whose second pickle calls ``posix.system``), and its torch wrapper
calls a clean state dict "likely unsafe"; picklescan sorts each global into its own allow-list,
its deny-list, or neither, which is the distinction a policy needs (docs/weights-safety.md).

Each file's verdict: ``dangerous`` (a global on the scanner's deny-list), ``unknown`` (a global
on neither list, e.g. a model class of a whole pickled module), ``unscannable`` (the pickle
breaks off after naming globals) or ``clean``. The allow-list is picklescan's plus what
``torch.load(weights_only=True)`` itself rebuilds (:data:`ALLOWED`).

The verdicts of an unpacked archive are kept beside the unpack cache
(``<run_dir>/unpacked/<sha256>.weights.json``), for this scanner version and allow-list, so a
restart or a second registration of the same bytes does not read the weights again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from server.rundir import write_json_atomic

log = logging.getLogger(__name__)


class _ModelRelativePaths(logging.Filter):
    """picklescan names each file it warns about by the path it was given: the unpacked model's
    folder under the run dir (the user's home, the host's layout). Its lines in the server's
    log name the file as the model knows it (``weights/model.pt``), as mserve's own do."""

    def __init__(self) -> None:
        super().__init__()
        self.scanning = threading.local()  # .folder: the model folder this thread scans

    def filter(self, record: logging.LogRecord) -> bool:
        folder = getattr(self.scanning, "folder", None)
        if folder:
            record.msg, record.args = record.getMessage().replace(folder, ""), None
        return True


_RELATIVE = _ModelRelativePaths()
logging.getLogger("picklescan").addFilter(_RELATIVE)

# Files unpickled by torch.load, pickle, joblib or numpy (allow_pickle): what is scanned.
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
VERDICTS = ("dangerous", "unknown", "unscannable")  # flagged; anything else is clean
CACHE_SUFFIX = ".weights.json"
_TENSOR_TYPES = ("Tensor", "Size", "device", "dtype", "float32", "float64", "float16",
                 "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
                 "complex128", "float8_e4m3fn", "float8_e5m2", "per_tensor_affine",
                 "per_channel_affine", "strided", "sparse_coo", "contiguous_format")  # fmt: skip
# Beyond picklescan's allow-list: the globals torch's weights_only unpickler accepts by default
# (what a state dict, an optimizer state or a checkpoint of tensors and numbers names), and
# TorchScript's own helpers (a torch.jit.save file's data.pkl, which torch.jit.load reads with
# its C++ unpickler). A module given as "*" allows every name in it.
ALLOWED: dict[str, Any] = {
    "torch": set(_TENSOR_TYPES)
    | {
        f"{k}Storage"
        for k in (
            "Untyped",
            "Float",
            "Double",
            "Half",
            "BFloat16",
            "Long",
            "Int",
            "Short",
            "Char",
            "Byte",
            "Bool",
            "ComplexFloat",
            "ComplexDouble",
        )
    },
    "torch._utils": {
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_qtensor",
        "_rebuild_sparse_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_nested_tensor",
        "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy",
    },
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.nn.parameter": {"Parameter"},
    "torch.serialization": {"_get_layout"},
    "torch.jit._pickle": "*",
    "collections": {"OrderedDict", "Counter"},
    "builtins": {"set", "frozenset", "slice", "complex", "bytearray", "range"},
    "__builtin__": {"set", "frozenset", "slice", "complex", "bytearray"},
    "_codecs": {"encode"},
    "numpy": {"dtype", "ndarray"},
    "numpy.dtypes": "*",
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.numeric": {"_frombuffer"},  # an array pickled with protocol 5
    "numpy._core.numeric": {"_frombuffer"},
}
# TorchScript classes: torch.jit.load resolves them to the archive's compiled code/, never to
# a Python import.
ALLOWED_PREFIXES = ("__torch__.",)


@dataclass(frozen=True)
class FileVerdict:
    """One weights file: its path in the model folder, verdict, and the globals that made it."""

    path: str
    verdict: str  # clean, dangerous, unknown, unscannable
    dangerous: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    @property
    def flagged(self) -> bool:
        return self.verdict in VERDICTS

    def reason(self) -> str:
        """What a refusal or a warning says about this file."""
        if self.dangerous:
            return f"{self.path} imports {', '.join(self.dangerous)}"
        if self.unknown:
            return f"{self.path} imports {', '.join(self.unknown)} (not on the allow-list)"
        return f"{self.path} could not be read to its end as a pickle"


@dataclass(frozen=True)
class WeightsScan:
    files: tuple[FileVerdict, ...]
    scanned_bytes: int
    seconds: float
    cached: bool = False

    @property
    def flagged(self) -> tuple[FileVerdict, ...]:
        return tuple(f for f in self.files if f.flagged)

    def shown(self) -> dict[str, Any]:
        """What describe shows."""
        return {
            "files": len(self.files),
            "flagged": [asdict(f) for f in self.flagged],
            "cached": self.cached,
        }


def scanner_identity() -> str:
    """The scanner's version and the allow-list's digest: a cached verdict of another is not
    reused."""
    allowed = json.dumps({k: sorted(v) if v != "*" else v for k, v in ALLOWED.items()},
                         sort_keys=True) + repr(ALLOWED_PREFIXES)  # fmt: skip
    digest = hashlib.sha256(allowed.encode()).hexdigest()[:12]
    return f"picklescan-{metadata.version('picklescan')}-{digest}"


def allowed(module: str, name: str) -> bool:
    names = ALLOWED.get(module)
    return names == "*" or (names is not None and name in names) or (
        module.startswith(ALLOWED_PREFIXES)
    )  # fmt: skip


def weights_files(model_dir: Path) -> list[Path]:
    """The files of ``model_dir`` (all depths) that a loader would unpickle, in name order;
    symbolic links are not followed (an unpacked archive has none)."""
    found = []
    for root, dirs, files in os.walk(model_dir):
        dirs.sort()
        for name in sorted(files):
            path = Path(root, name)
            if name.lower().endswith(PICKLE_SUFFIXES) and not path.is_symlink():
                found.append(path)
    return found


def scan_file(path: Path, rel: str) -> FileVerdict:
    """One file's verdict (blocking). picklescan streams it: a torch zip's members are opened
    in place (8 bytes of each storage read), a legacy file's pickles end before its storages."""
    from picklescan.scanner import SafetyLevel, scan_file_path

    result = scan_file_path(str(path))
    dangerous, unknown = set(), set()
    for g in result.globals:
        dotted = f"{g.module}.{g.name}"
        if g.safety is SafetyLevel.Dangerous:
            dangerous.add(dotted)
        elif g.safety is not SafetyLevel.Innocuous and not allowed(g.module, g.name):
            unknown.add(dotted)
    if dangerous:
        verdict = "dangerous"
    elif unknown:
        verdict = "unknown"
    elif result.scan_err:
        verdict = "unscannable"
    else:
        verdict = "clean"
    return FileVerdict(rel, verdict, tuple(sorted(dangerous)), tuple(sorted(unknown)))


def scan_folder(model_dir: Path) -> WeightsScan:
    """Every weights file of ``model_dir`` (blocking: call it in a thread)."""
    started = time.monotonic()
    files, size = [], 0
    _RELATIVE.scanning.folder = os.path.join(str(model_dir), "")
    try:
        for path in weights_files(model_dir):
            rel = path.relative_to(model_dir).as_posix()
            size += path.stat().st_size
            files.append(scan_file(path, rel))
    finally:
        _RELATIVE.scanning.folder = None
    return WeightsScan(tuple(files), size, time.monotonic() - started)


def cached_scan(model_dir: Path, marker: Path | None) -> WeightsScan:
    """:func:`scan_folder`, or the verdicts ``marker`` kept for the same bytes (an unpacked
    archive's folder is named for its sha256; a folder archive has no marker and is scanned
    each time). The marker is written by :func:`keep`, once the registration accepted them."""
    if marker is not None:
        try:
            kept = json.loads(marker.read_text())
            if kept.get("scanner") == scanner_identity():
                files = tuple(FileVerdict(f["path"], f["verdict"], tuple(f["dangerous"]),
                                          tuple(f["unknown"])) for f in kept["files"])  # fmt: skip
                return WeightsScan(files, int(kept["scanned_bytes"]), 0.0, cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return scan_folder(model_dir)


def keep(scan: WeightsScan, marker: Path) -> None:
    """Record ``scan`` for the next registration of the same bytes."""
    if scan.cached:
        return
    data = {
        "scanner": scanner_identity(),
        "scanned_bytes": scan.scanned_bytes,
        "scan_s": round(scan.seconds, 3),
        "files": [asdict(f) for f in scan.files],
    }
    try:
        write_json_atomic(marker, data, durable=False)
    except OSError as exc:  # the next registration scans again: slower, still right
        log.warning("could not write %s: %s", marker, exc)
