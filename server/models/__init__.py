"""Supervision of the registered models: the registry (registration, versions, defaults), each
version's settings, worker slots and batch dispatch (version.py), its job queue and batching
(batching.py), and residency (load on demand, idle unload, the memory budget). The worker
processes themselves are server/workers/."""
