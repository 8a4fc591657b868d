"""The model config's ``pt2`` section, read as TorchServe's ``BaseHandler`` reads it: the loaded
model is passed through ``torch.compile`` with the options it names.

Three forms, all TorchServe's::

    pt2: {compile: {enable: true, backend: inductor, mode: reduce-overhead, options: {...}}}
    pt2: inductor                                 # older: the backend alone
    pt2: {backend: inductor, mode: reduce-overhead}   # older: torch.compile's keyword arguments

``compile.enable`` false (or absent) compiles nothing, nor does a section with ``export`` (an
AOT-compiled package, loaded as it is). A backend neither TorchServe nor this torch knows serves
the model uncompiled, and so does a ``torch.compile`` call that raises; each says so in the
model's log. ``torch.compile`` compiles at the model's first call, so loading stays quick and the
first request pays for it.

Runs inside a worker: standard library only at import time; torch is imported when a model is
compiled.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

_log = logging.getLogger(__name__)


class PT2Backend(str, enum.Enum):
    """The ``torch.compile`` backends TorchServe accepts in a ``pt2`` section."""

    EAGER = "eager"
    AOT_EAGER = "aot_eager"
    INDUCTOR = "inductor"
    NVFUSER = "nvfuser"
    AOT_NVFUSER = "aot_nvfuser"
    AOT_CUDAGRAPHS = "aot_cudagraphs"
    OFI = "ofi"
    FX2TRT = "fx2trt"
    ONNXRT = "onnxrt"
    IPEX = "ipex"
    TORCHXLA_TRACE_ONCE = "torchxla_trace_once"
    OPENVINO = "openvino"
    TENSORRT = "tensorrt"
    HPU_BACKEND = "hpu_backend"


def check_valid_pt2_backend(backend: str) -> bool:
    """Whether TorchServe accepts ``backend`` (``ts.utils.util``'s check)."""
    return backend in {member.value for member in PT2Backend}


def compile_options(pt2: Any) -> dict[str, Any] | None:
    """The keyword arguments of ``torch.compile`` the ``pt2`` value asks for; None when it asks
    for no compilation. Raises ValueError for a value of no known form."""
    if isinstance(pt2, str):
        _log.warning("pt2: <backend> is TorchServe's older form; write pt2: {compile: "
                     "{enable: true, backend: %s}}", pt2)  # fmt: skip
        return {"backend": pt2}
    if not isinstance(pt2, dict):
        raise ValueError(
            f"the model config's pt2 must be a backend name or a mapping (pt2: {{compile: "
            f"{{enable: true, backend: inductor}}}}), found {type(pt2).__name__} {pt2!r:.80}"
        )
    if "compile" in pt2:
        section = pt2["compile"]
        if not isinstance(section, dict):
            raise ValueError(
                f"the model config's pt2.compile must be a mapping ({{enable: true, backend: "
                f"inductor}}), found {type(section).__name__} {section!r:.80}"
            )
        if not section.get("enable"):
            _log.info("pt2.compile.enable is not true: the model is not compiled")
            return None
        return {k: v for k, v in section.items() if k != "enable"}
    if "export" in pt2:
        return None
    _log.warning("pt2: {backend: ...} is TorchServe's older form; write pt2: {compile: "
                 "{enable: true, ...}}")  # fmt: skip
    return dict(pt2)


def compile_model(model: Any, pt2: Any) -> Any:
    """``model`` through ``torch.compile`` as ``pt2`` asks, or ``model`` itself."""
    options = compile_options(pt2)
    if options is None:
        return model
    described = ", ".join(f"{k} {v}" for k, v in options.items())
    backend = options.get("backend")
    if isinstance(backend, str) and not _known_backend(backend):
        _log.warning(
            "pt2 backend %r is neither one TorchServe accepts (%s) nor one this torch lists: "
            "the model is served without compilation",
            backend, ", ".join(member.value for member in PT2Backend),
        )  # fmt: skip
        return model
    import torch

    try:
        compiled = torch.compile(model, **options)
    except Exception as exc:  # TorchServe serves on uncompiled; so do we, and say why
        _log.warning(
            "Compiling model with %s has failed (%s: %s); proceeding without compilation",
            described, type(exc).__name__, exc,
        )  # fmt: skip
        return model
    _log.info("Compiled model with %s", described)  # TorchServe's words: scripts grep them
    return compiled


def _known_backend(backend: str) -> bool:
    if check_valid_pt2_backend(backend):
        return True
    try:  # a backend registered with torch (a plugin's) compiles too
        from torch._dynamo import list_backends

        return backend in list_backends(exclude_tags=())
    except Exception:  # a private API: without it, TorchServe's list decides
        return False
