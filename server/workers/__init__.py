"""Worker processes: supervisor (parent side) and the stdlib-only runtime (child side)."""
