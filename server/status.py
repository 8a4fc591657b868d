"""What ``mserve --status`` and ``status.json`` say about each model: one word per state, or
per version when its versions differ; models that failed to register at start are listed too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.models.registry import Registry
    from server.models.version import ModelVersion


def models_status(registry: Registry, load_failures: dict[str, str]) -> dict[str, str]:
    """Each model's state (:func:`model_state`), per version when its versions differ, after
    the startup or snapshot models that failed to register (``load_failures``)."""
    out = dict(load_failures)
    for name, versions in sorted(registry.models.items()):
        states = {version: model_state(mv) for version, mv in versions.items()}
        if len(set(states.values())) == 1:
            out[name] = next(iter(states.values()))
        else:
            out[name] = ", ".join(f"{version} {state}" for version, state in states.items())
    return out


def model_state(mv: ModelVersion) -> str:
    """``ready`` (its workers serve), ``unloaded`` (no worker; ``loads on demand`` when a
    request starts one), ``loading`` or ``failed: why``."""
    if mv.failed is not None:
        return f"failed: {mv.failed}"
    if mv.stage:
        return f"loading ({mv.stage})"
    state = mv.load_state()
    if state == "unloaded" and mv.healthy():
        return "unloaded (loads on demand)" if mv.loads_on_demand() else "unloaded"
    if state == "loaded" and mv.healthy():
        return "ready"
    return "loading"


def confinement_text(report: dict[str, Any] | None) -> str:
    """One worker's confinement in words: what it applied, or why nothing was."""
    if report is None:
        return "not confined (sandbox off)"
    applied = ", ".join(report.get("applied") or ()) or "nothing"
    if report.get("reason"):
        return f"not confined: {report['reason']} (applied: {applied})"
    return f"confined: {applied}"


def sandbox_status(registry: Registry) -> dict[str, Any]:
    """The sandbox setting, and each ready worker's confinement (:func:`confinement_text`)."""
    workers = {
        f"{mv.label} W-{worker_id}": confinement_text(report)
        for mv in registry.all()
        for worker_id, report in mv.worker_sandboxes()
    }
    return {"setting": registry.sandbox.summary(), "workers": workers}
