"""The mserve server process: its command, its HTTP and gRPC frontends, the supervision of
models and their workers, and its configuration and run dir (README.md, Layout)."""
