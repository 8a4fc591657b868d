"""The OpenAI-compatible API on the inference port, under ``/openai/v1/`` as KServe serves it
(so KServe v1's ``/v1/models/...`` keeps its meaning): chat completions, completions,
embeddings and the models list, for the models whose config declares a ``generative:`` section
(docs/generative.md).

request.py validates a request and turns it into the JSON the handler receives; pieces.py reads
what the handler sends back (text pieces, token counts) and applies ``stop`` and
``max_tokens``; api.py runs the jobs on the model's queue and answers, streamed as server-sent
events or whole.
"""
