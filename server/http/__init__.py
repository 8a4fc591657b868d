"""Our HTTP/1.1 server, on all three ports: connections over httptools' parser, routing left to
each port's router (server/rest/inference.py, server/rest/management.py,
server/metrics/server_metrics.py).

Why not aiohttp: on the inference path the server's whole job is to move a body to a worker and
an answer back, and aiohttp's request, response, router and middleware objects cost ~100-140 us
of CPU per request (a bare protocol over httptools: ~12-22 us, scripts/bench_server.py and
docs/apis.md, HTTP); importing aiohttp also cost ~0.25 s of every cold start. The parsing is
httptools' (llhttp, Node.js's parser: request line, headers, Content-Length and chunked framing,
the request smuggling cases); this package keeps what our APIs need: keep-alive, pipelined
requests answered in order, size limits, idle timeouts, write flow control, the access log, and
TorchServe's JSON error body for every refusal. A router answers at once
(:meth:`Connection.answer`) or from a callback or task later; nothing here makes a coroutine
per request.

One module per piece, as uvicorn lays out its protocols: the request and its limits
(request.py), answers as bytes (answer.py), the connection and its flow control
(connection.py) with its lingering close after a refusal (linger.py), streamed answers
(chunked.py), the listener (server.py). What a port's paths mean is its router's alone: this
package imports nothing from server/rest/ or above.
"""

from server.http.answer import JSON, Answer, error_body, header_problem, json_answer
from server.http.chunked import ChunkedAnswer, StreamSource
from server.http.connection import Connection
from server.http.request import Request
from server.http.server import HttpServer, Router

__all__ = [
    "JSON",
    "Answer",
    "ChunkedAnswer",
    "Connection",
    "HttpServer",
    "Request",
    "Router",
    "StreamSource",
    "error_body",
    "header_problem",
    "json_answer",
]
