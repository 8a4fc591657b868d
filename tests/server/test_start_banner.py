"""The start banner names what is on that a newcomer would otherwise find only in the log
(issue 47): where traces go (and a collector that does not answer), and the memory limits that
evict models."""

from __future__ import annotations


def test_banner_names_tracing_and_the_memory_budget(start_server) -> None:
    server = start_server(
        config={
            "otel_endpoint": "http://127.0.0.1:9/v1/traces",  # nothing listens: export fails later
            "otel_sampling_ratio": 0.25,
            "worker_memory_budget_mb": 2048,
            "max_loaded_models": 3,
        }
    )
    out = server.start_output
    assert (
        "  tracing    OTLP http/protobuf to http://127.0.0.1:9/v1/traces, sampling 0.25 of new"
        " traces" in out
    ), out
    memory = "  memory     at most workers' memory 2048 MB, 3 models loaded (idle models evicted by"
    assert f"{memory} cost)" in out, out
    # a collector that is down is said at start, not only in the log seconds later
    assert (
        "mserve: WARNING: tracing: the OTLP collector at 127.0.0.1:9 does not answer"
        " (Connection refused); spans are dropped until it does" in out
    ), out
    status = server.cli("--status").stdout
    assert "tracing    OTLP http/protobuf" in status and "memory     at most" in status


def test_banner_says_nothing_of_them_when_off(start_server) -> None:
    out = start_server().start_output
    assert "tracing" not in out and "memory " not in out, out
