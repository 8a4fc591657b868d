"""Imports torch at the top, as most PyTorch handlers do: what its template learns to preload."""

import torch


def handle(data, context):
    if not data:
        return None
    return [{"torch": torch.__version__} for _ in data]
