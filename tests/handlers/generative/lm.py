"""A stand-in language model for the OpenAI API tests (module-function style, no torch): it
"generates" words, streaming one piece per word as a generator, with what a generative handler
reports (docs/generative.md): ``{"text", "tokens", "prompt_tokens"}``.

A prompt counts one token per word. The answer: ``say: w1 w2 ...`` in the last message repeats
those words; otherwise words drawn from the request's ``seed`` (temperature 0: always seed 0).
``WHOAMI`` in the prompt answers the request's id (one word);
``FAIL`` in the prompt raises after two words; ``SLOW`` sleeps 50 ms a word. A prompt over
CONTEXT words is refused with PredictionException 400, before any piece. An embedding request
gets an 8-dimension vector of the text's letters (``NAN`` in it: NaN and infinities first).
"""

import random
import time

from ts.utils.util import PredictionException

CONTEXT = 64
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def handle(data, context):
    if not data:
        return None
    out = []
    for idx, row in enumerate(data):
        request = row["body"]
        if request["kind"] == "embedding":
            text = request["input"]
            vector = [float(sum(1 for ch in text if ord(ch) % 8 == i)) for i in range(8)]
            if "NAN" in text:  # a model whose vector went bad
                vector[:3] = [float("nan"), float("inf"), float("-inf")]
            out.append({"embedding": vector, "prompt_tokens": len(text.split())})
            continue
        prompt = request["prompt"]
        tokens = len(prompt.split())
        if tokens > CONTEXT:
            raise PredictionException(
                f"the prompt is {tokens} tokens, more than this model's context of {CONTEXT}",
                400,
            )
        if "WHOAMI" in prompt:
            request = {**request, "messages": [{"content": "say: " + context.get_request_id(idx)}]}
        out.append(_generate(request, prompt, tokens))
    return out


def _generate(request, prompt, prompt_tokens):
    last = (request.get("messages") or [{"content": prompt}])[-1]["content"]
    seed = 0 if request.get("temperature") == 0 else request.get("seed")
    rng = random.Random(seed)
    if last.startswith("say: "):
        words = last[len("say: ") :].split()
    else:
        words = [rng.choice(WORDS) for _ in range(request["max_tokens"])]
    for i, word in enumerate(words[: request["max_tokens"]]):
        if "FAIL" in prompt and i == 2:
            raise RuntimeError("the model broke mid-stream")
        if "SLOW" in prompt:
            time.sleep(0.05)
        piece = {"text": word if i == 0 else " " + word, "tokens": 1}
        if i == 0:
            piece["prompt_tokens"] = prompt_tokens
        yield piece
