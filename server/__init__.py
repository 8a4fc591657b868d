"""The mserve server process (arrives with issue 3)."""
