"""Drivers of the hooks style (what runs between a stage's ``preprocess`` and ``postprocess``)
and :func:`stage_configs`, which reads the stages and their drivers from the model config.

This runs inside a worker process, in the model's own Python environment: standard library only
at import time, Python 3.8+. numpy and torch are imported when a driver that needs them loads.

A driver takes the stage's inputs (after its preprocess hook) and returns its outputs (before its
postprocess hook). Each driver also gives the hooks of its stage keyword arguments
(:meth:`hook_kwargs`), the ones kibernetika-serving documents for that driver.

``null``
    Returns its inputs unchanged; all the logic lives in the hooks. Hooks get ``driver``.
``pytorch``
    Loads one ``torch.nn.Module`` from the stage's weights file and runs it; hooks get ``model``,
    ``model_class`` and ``driver``. See :class:`PyTorchDriver` for how inputs reach the model.
"""

from __future__ import annotations

import difflib
import importlib
import os
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

from ..contract import HandlerLoadError, create_instance
from .weights import load_weights


class NullDriver:
    """The identity: outputs are the inputs, whatever they are."""

    name = "null"
    hook_kwarg_names = ("driver",)

    def __init__(self, label: str, model_path: str | None, options: dict[str, Any], gpu_id: Any):
        self.label = label
        self.model_path = model_path
        self.options = options

    def hook_kwargs(self) -> dict[str, Any]:
        return {"driver": self}

    def predict(self, inputs: Any) -> Any:
        return inputs

    def close(self) -> None:
        """Nothing to release."""


class PyTorchDriver:
    """One ``nn.Module`` in eval mode, on ``cuda:{gpu_id}`` when CUDA is available, else the CPU.

    The weights file (the stage's ``model_path``) may hold:

    - a state dict: ``options.model_class`` (``module:Class`` or ``module.Class``, imported from
      the model folder) is created with no arguments and the state dict loaded into it;
    - a TorchScript archive (``torch.jit.save``): loaded as it is, ``model_class`` not needed;
    - a whole pickled module (``torch.save(model)``): loaded as it is, without ``model_class``;
      its class must be importable from the model folder.

    Inputs must be a dict of arrays. Each becomes a tensor on the model's device; floating-point
    arrays take the dtype of the model's first floating-point parameter (JSON numbers arrive as
    float64), integer and boolean arrays keep theirs. One input is passed positionally,
    ``model(x)``; several are passed by name, ``model(**inputs)``, so their names must be the
    ``forward`` parameter names. The model runs under ``torch.inference_mode()``. Its result
    becomes a dict of numpy arrays: a tensor is ``{"output": ...}``, a tuple or list is
    ``{"output_0": ..., "output_1": ...}``, a dict keeps its keys.
    """

    name = "pytorch"
    hook_kwarg_names = ("model", "model_class", "driver")

    def __init__(self, label: str, model_path: str | None, options: dict[str, Any], gpu_id: Any):
        try:
            import torch
        except ImportError as exc:
            raise HandlerLoadError(
                f"{label}: the pytorch driver needs torch in the model's environment; add it to "
                f"the archive's requirements file ({exc})"
            ) from exc
        self._torch = torch
        self.label = label
        self.model_path = model_path
        self.options = options
        spec = options.get("model_class")
        if spec is not None and (not isinstance(spec, str) or not spec.strip()):
            raise HandlerLoadError(
                f"{label}: option 'model_class' must be an import path such as "
                f"'package.module:NetClass', found {spec!r}"
            )
        if not model_path:
            raise HandlerLoadError(
                f"{label} needs a weights file: set 'model_path' in the model config "
                f"or archive the model with --serialized-file"
            )
        if not os.path.isfile(model_path):
            folder = os.path.dirname(model_path) or "."
            raise HandlerLoadError(
                f"{label}: model_path {model_path!r} is not a file; {folder} has: "
                f"{', '.join(sorted(os.listdir(folder))[:30]) if os.path.isdir(folder) else '-'}"
            )
        if gpu_id is not None and torch.cuda.is_available():
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.device = torch.device("cpu")
        self.model_class: Any = _import_class(spec, label) if spec else None
        self.model = self._load()
        self.model.eval()
        if self.model_class is None:
            self.model_class = type(self.model)
        self._float = next(
            (p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32
        )

    def _load(self) -> Any:
        torch = self._torch
        path = self.model_path
        if _is_torchscript(path):
            return torch.jit.load(path, map_location=self.device)
        if self.model_class is not None:
            try:
                state = load_weights(path, map_location=self.device, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise HandlerLoadError(
                    f"{self.label}: {path} is not a plain state dict (it pickles objects), but "
                    f"option 'model_class' says to load one; leave model_class out to load a "
                    f"whole pickled module"
                ) from exc
            if not isinstance(state, dict):
                raise HandlerLoadError(
                    f"{self.label}: {path} holds a {type(state).__name__}, not a state dict for "
                    f"model_class {self.options['model_class']!r}"
                )
            model = create_instance(self.model_class, self.options["model_class"])
            if not isinstance(model, torch.nn.Module):
                raise HandlerLoadError(
                    f"{self.label}: model_class {self.options['model_class']!r} is not a "
                    f"torch.nn.Module subclass"
                )
            try:
                model.load_state_dict(state)
            except RuntimeError as exc:
                raise HandlerLoadError(
                    f"{self.label}: the state dict in {path} does not fit model_class "
                    f"{self.options['model_class']!r}: {exc}"
                ) from exc
            return model.to(self.device)
        # A whole pickled module: unpickling runs code, as torch.save(model) requires. The
        # archive is the model author's own, loaded as TorchServe loads it.
        model = load_weights(path, map_location=self.device, weights_only=False)
        if isinstance(model, torch.nn.Module):
            return model.to(self.device)
        kind = "a state dict" if isinstance(model, dict) else f"a {type(model).__name__}"
        raise HandlerLoadError(
            f"{self.label}: {path} holds {kind}; set option 'model_class' to the module's class "
            f"(e.g. options: {{model_class: 'net:Net'}}) so the driver can create the model"
        )

    def hook_kwargs(self) -> dict[str, Any]:
        return {"model": self.model, "model_class": self.model_class, "driver": self}

    def predict(self, inputs: Any) -> dict[str, Any]:
        if not isinstance(inputs, dict):
            raise TypeError(
                f"{self.label}: the pytorch driver needs a dict of input name -> array, "
                f"got {type(inputs).__name__}"
            )
        torch = self._torch
        tensors = {name: self._tensor(name, value) for name, value in inputs.items()}
        with torch.inference_mode():
            if len(tensors) == 1:
                result = self.model(next(iter(tensors.values())))
            else:
                result = self.model(**tensors)
        return _outputs(result, torch)

    def _tensor(self, name: str, value: Any) -> Any:
        import numpy

        torch = self._torch
        if isinstance(value, torch.Tensor):
            tensor = value
        else:
            array = numpy.asarray(value)
            if array.dtype.kind not in "biuf":
                raise TypeError(
                    f"{self.label}: input {name!r} is an array of {array.dtype}, which a model "
                    f"cannot take; convert it to numbers in a preprocess hook"
                )
            tensor = torch.as_tensor(array)
        if tensor.is_floating_point():
            tensor = tensor.to(self._float)
        return tensor.to(self.device)

    def close(self) -> None:
        """Drop the model so that its (GPU) memory can be freed."""
        self.model = None


def _is_torchscript(path: str) -> bool:
    """``torch.jit.save`` archives hold ``constants.pkl``; ``torch.save`` zips do not."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.endswith("/constants.pkl") for n in archive.namelist())


def _import_class(spec: str, label: str) -> Any:
    """``package.module:Class`` (or ``package.module.Class``) from the model folder."""
    module_name, colon, attribute = spec.strip().partition(":")
    if not colon:
        module_name, _, attribute = module_name.rpartition(".")
    if not module_name or not attribute:
        raise HandlerLoadError(
            f"{label}: option 'model_class' {spec!r} is not an import path such as "
            f"'package.module:NetClass'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name not in {".".join(parts[: i + 1]) for i in range(len(parts))}:
            raise  # a dependency of the user's module is missing: their error, as raised
        raise HandlerLoadError(
            f"{label}: option 'model_class' {spec!r}: module {module_name!r} not found in the "
            f"model folder or the model's environment"
        ) from None
    cls = getattr(module, attribute, None)
    if cls is None:
        raise HandlerLoadError(
            f"{label}: option 'model_class' {spec!r}: module {module_name!r} has no {attribute!r}"
        )
    if not isinstance(cls, type):
        raise HandlerLoadError(
            f"{label}: option 'model_class' {spec!r} is a {type(cls).__name__}, not a class"
        )
    return cls


def _outputs(result: Any, torch: Any) -> dict[str, Any]:
    def numpy_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
        return value

    if isinstance(result, dict):
        return {str(k): numpy_of(v) for k, v in result.items()}
    if isinstance(result, (tuple, list)):
        return {f"output_{i}": numpy_of(v) for i, v in enumerate(result)}
    return {"output": numpy_of(result)}


STAGE_KEYS = ("driver", "model_path", "options")
# init_hook parameters the server sets, which options may not
RESERVED_PARAMS = ("model_path", "model_paths", "model_dir")


@dataclass(frozen=True)
class StageConfig:
    """One stage as the model config sets it; ``label`` names it in every message."""

    label: str
    driver: str
    model_path: str | None  # absolute, or None when neither the config nor the manifest has one
    options: dict[str, Any]


def stage_configs(
    config: dict[str, Any] | None, model_dir: str, default_path: str | None
) -> list[StageConfig]:
    """The stages the model config asks for (one ``null`` stage when it names none); errors
    name the key at fault."""
    config = config or {}
    for key in config:
        close = difflib.get_close_matches(str(key), (*STAGE_KEYS, "pipeline"), n=1, cutoff=0.8)
        if close and key != close[0]:  # a misspelt key would silently mean "one null stage"
            raise HandlerLoadError(
                f"model config key {key!r} is not a hooks-style setting; did you mean "
                f"{close[0]!r}? (the top-level keys are pipeline, {', '.join(STAGE_KEYS)})"
            )
    if "pipeline" not in config:
        entry = {key: config[key] for key in STAGE_KEYS if key in config}
        return [_stage("", entry, model_dir, default_path)]
    both = [key for key in STAGE_KEYS if key in config]
    if both:
        raise HandlerLoadError(
            f"model config sets both 'pipeline' and {', '.join(repr(k) for k in both)}; "
            f"with a pipeline, set driver, model_path and options in each stage"
        )
    pipeline = config["pipeline"]
    if not isinstance(pipeline, list) or not pipeline:
        raise HandlerLoadError(
            f"model config key 'pipeline' must be a non-empty list of stages (mappings with "
            f"{', '.join(STAGE_KEYS)}), found {pipeline!r}"
        )
    return [
        _stage(f"pipeline[{i}]", entry, model_dir, default_path) for i, entry in enumerate(pipeline)
    ]


def _stage(where: str, entry: Any, model_dir: str, default_path: str | None) -> StageConfig:
    def key(name: str) -> str:
        return repr(f"{where}.{name}" if where else name)

    if not isinstance(entry, dict):
        raise HandlerLoadError(
            f"model config key {where!r} must be a mapping with {', '.join(STAGE_KEYS)}, "
            f"found {entry!r}"
        )
    unknown = sorted(str(k) for k in entry if k not in STAGE_KEYS)
    if unknown:
        raise HandlerLoadError(
            f"model config key {key(unknown[0])} is not a stage setting; a stage has "
            f"{', '.join(STAGE_KEYS)}"
        )
    driver = entry.get("driver", "null")
    if not isinstance(driver, str) or not driver.strip():
        raise HandlerLoadError(
            f"model config key {key('driver')} must be a driver name, found {driver!r}"
        )
    path = entry.get("model_path", default_path)
    if path is not None and (not isinstance(path, str) or not path):
        raise HandlerLoadError(
            f"model config key {key('model_path')} must be a file path relative to the model "
            f"folder, found {path!r}"
        )
    options = entry.get("options") or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise HandlerLoadError(
            f"model config key {key('options')} must be a mapping of option names to values, "
            f"found {options!r}"
        )
    reserved = [name for name in RESERVED_PARAMS if name in options]
    if reserved:
        raise HandlerLoadError(
            f"model config key {key('options.' + reserved[0])}: the server sets "
            f"{reserved[0]!r}; use the stage's model_path key"
        )
    driver = driver.strip().lower()
    return StageConfig(
        label=f"{where} ({driver} driver)" if where else f"{driver} driver",
        driver=driver,
        model_path=os.path.join(model_dir, path) if path else None,
        options=dict(options),
    )


DRIVERS = {NullDriver.name: NullDriver, PyTorchDriver.name: PyTorchDriver}


def driver_class(name: Any, label: str) -> Any:
    """The driver class called ``name`` (case does not matter); unknown names fail at load."""
    driver = DRIVERS.get(name.lower()) if isinstance(name, str) else None
    if driver is None:
        raise HandlerLoadError(
            f"{label}: unknown driver {name!r}; known drivers: {', '.join(DRIVERS)}"
        )
    return driver
