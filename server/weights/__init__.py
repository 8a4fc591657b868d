"""Weights that carry code, and what a model's environment holds (docs/weights-safety.md).

:mod:`server.weights.scan` finds the imports a pickled weights file would make before anything
unpickles it; :mod:`server.weights.policy` applies ``weights_scan`` (off, warn, require) at
registration; :mod:`server.weights.sbom` records a CycloneDX SBOM of each model environment.
"""
