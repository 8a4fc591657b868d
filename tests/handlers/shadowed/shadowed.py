"""One handler, several versions, for the shadow tests (tests/server/test_shadow.py): each
answer depends on the version in the archive's manifest. 1.0 and 1.1 answer alike; 2.0 moves
the score by 0.001; 3.0 changes the label; 9.0 hangs; 9.1 kills its worker. A request with
"big": true gets a long embedding too."""

import json
import os
import time


def handle(data, context):
    if data is None:
        return None
    version = context.model_version
    if version == "9.0":
        time.sleep(3600)
    if version == "9.1":
        os._exit(3)
    answers = []
    for row in data:
        body = row.get("body") if row.get("body") is not None else row.get("data")
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        x = float(body["x"])
        score = x + 0.001 if version == "2.0" else x
        label = "dog" if version == "3.0" else "cat"
        answer = {"predictions": [{"label": label, "score": score}], "x": x}
        if body.get("big"):  # an answer of about 100 KB: compared off the event loop
            answer["embedding"] = [x / 3] * 10_000
        answers.append(answer)
    return answers
