"""Answers which version of the model it is; its model config's ``rollout_test`` section makes a
version bad on purpose (fault injection for the canary's guard): ``fail: true`` raises on every
request (500), ``delay_ms: N`` sleeps N ms per batch."""

import time


def handle(data, context):
    if data is None:
        return None
    version = context.manifest["model"]["modelVersion"]
    faults = (context.model_yaml_config or {}).get("rollout_test") or {}
    if faults.get("fail"):
        raise RuntimeError(f"version {version} fails on purpose")
    if faults.get("delay_ms"):
        time.sleep(faults["delay_ms"] / 1000)
    return [{"version": version} for _ in data]
