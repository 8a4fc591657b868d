"""Supervision of the registered models: the registry (registration, versions, defaults), each
version's worker slots (version.py), its settings (settings.py), the batch pump that feeds each
worker (pump.py), its job queue and batching (batching.py), and residency (load on demand, idle
unload, the memory budget). The worker processes themselves are server/workers/."""
