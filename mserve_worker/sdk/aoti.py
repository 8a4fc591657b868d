"""AOTInductor models for ``BaseHandler``: a serialized file compiled ahead of time by
``torch._inductor`` is loaded as the callable torch gives for it, not with ``torch.jit.load``.

Two kinds of file:

- ``.so``, the shared library ``torch._export.aot_compile`` writes: loaded with
  ``torch._export.aot_load(path, device)``, as TorchServe's BaseHandler loads it, and on the same
  condition: the model config says ``pt2: {export: {aot_compile: true}}`` (TorchServe's
  ``examples/pt2/torch_export_aot_compile``). Without it, TorchServe fails with "No model weights
  could be loaded"; here the error says which key is missing.
- ``.pt2``, the package ``torch._inductor.aoti_compile_and_package`` writes (what torch now
  recommends instead of ``aot_compile``): loaded with ``torch._inductor.aoti_load_package``.
  TorchServe's BaseHandler has no such branch; the package names itself, so no config is needed.

Neither is compiled here: the library inside was built when the model was exported, for the
device it was exported for. Runs inside a worker: standard library only at import time; torch is
imported when a model is loaded.
"""

from __future__ import annotations

import logging
import os
import zipfile
from typing import Any

_log = logging.getLogger(__name__)

SHARED_LIBRARY = ".so"
PACKAGE = ".pt2"
_PACKAGE_MODEL = "/data/aotinductor/"  # where a package keeps its compiled model


def wants_aot_compile(model_yaml_config: dict[str, Any] | None) -> bool:
    """Whether the model config asks for an AOT-compiled library (``pt2.export.aot_compile``),
    TorchServe's ``_use_torch_export_aot_compile``."""
    pt2 = (model_yaml_config or {}).get("pt2")
    export = pt2.get("export") if isinstance(pt2, dict) else None
    return isinstance(export, dict) and bool(export.get("aot_compile"))


def is_aoti_file(path: str) -> bool:
    """Whether ``path`` names an AOTInductor library or package, by its suffix."""
    return path.endswith((SHARED_LIBRARY, PACKAGE))


def load(path: str, device: Any, model_yaml_config: dict[str, Any] | None) -> Any:
    """The callable for the ``.so`` or ``.pt2`` at ``path`` on ``device`` (a torch.device).
    Raises ValueError, in words for the model's author, for a file that cannot be one."""
    name = os.path.basename(path)
    if path.endswith(SHARED_LIBRARY):
        if not wants_aot_compile(model_yaml_config):
            raise ValueError(
                f"{name} is a shared library, which BaseHandler loads as an AOTInductor model "
                f"(torch._export.aot_load) when the model config says pt2: {{export: "
                f"{{aot_compile: true}}}}, as TorchServe's does; add that to the model config "
                f"(model-archiver -c), or override initialize()"
            )
        return load_shared_library(path, device)
    return load_package(path, device)


def load_shared_library(path: str, device: Any) -> Any:
    """``torch._export.aot_load``, on the worker's GPU when it has one (TorchServe sets the
    current CUDA device first: aot_load of its time took no index)."""
    import torch
    import torch._export

    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = torch._export.aot_load(os.path.abspath(path), str(device))
    _log.info("Loaded AOTInductor library %s with torch._export.aot_load on %s", path, device)
    return model


def load_package(path: str, device: Any) -> Any:
    """``torch._inductor.aoti_load_package``; a ``.pt2`` without a compiled model (such as
    ``torch.export.save`` writes) is refused, naming the call that makes one."""
    import torch._inductor

    name = os.path.basename(path)
    try:
        with zipfile.ZipFile(path) as package:
            compiled = any(_PACKAGE_MODEL in member for member in package.namelist())
    except zipfile.BadZipFile:
        compiled = False
    if not compiled:
        raise ValueError(
            f"{name} holds no AOTInductor model (no data/aotinductor/ in the package); "
            f"BaseHandler loads .pt2 files written by "
            f"torch._inductor.aoti_compile_and_package(torch.export.export(model, ...))"
        )
    index = device.index if device.type == "cuda" and device.index is not None else -1
    from torch._inductor import config

    # Loading compares the package's CPU vector ISA with this machine's, for a warning only;
    # torch finds this machine's by building a test kernel per ISA with the C++ compiler (35 s
    # on 2 busy cores, again in each worker's fresh cache, and it fails without a compiler).
    # The CPU's own flags tell the ISA; the built library needs no compiler. An operator's
    # TORCHINDUCTOR_VEC_ISA_OK still decides.
    trust_cpu_flags = {} if config.cpp.vec_isa_ok is not None else {"cpp.vec_isa_ok": True}
    with config.patch(trust_cpu_flags):
        model = torch._inductor.aoti_load_package(path, device_index=index)
    _log.info("Loaded AOTInductor package %s with torch._inductor.aoti_load_package", path)
    return model
