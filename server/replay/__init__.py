"""``mserve replay``: send what an inference log recorded to a model version or another server
and compare the answers (docs/replay.md).

A client: it reads log files or captured CloudEvents (records.py), sends each request to the
target's API (target.py) with bounded concurrency or at the recorded pace (run.py), compares
each answer with the recorded one with server/compare (the shadow diffs' comparison), and
reports in the terminal, as JSON with an exit code for CI (report.py) and as an HTML page
(html.py). It imports no runtime piece of the server.
"""
