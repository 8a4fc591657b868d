"""A TorchServe-style streaming handler (module function), written as TorchServe documents it.

Each request's JSON body says what its stream does: ``name`` (put in every chunk), ``parts``
(intermediate chunks before the returned last one), ``sleep`` (seconds between parts),
``fail_after`` (raise after that many parts; a ``PredictionException`` with the status in
``prediction_error`` when given, else a RuntimeError), ``status`` and ``header`` (set on the response
before the first chunk). Requests of one batch stream side by side, each its own chunks.
"""

import time

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.utils.util import PredictionException


def _spec(row):
    body = row.get("body") or row.get("data") or {}
    return body if isinstance(body, dict) else {}


def handle(data, context):
    if data is None:
        return None
    specs = [_spec(row) for row in data]
    for idx, spec in enumerate(specs):
        if "status" in spec:
            context.set_response_status(spec["status"], "", idx)
        if "header" in spec:
            context.set_response_header(idx, "X-Stream", spec["header"])
    longest = max(int(s.get("parts", 0)) for s in specs)
    for part in range(longest):
        if part and any(s.get("sleep") for s in specs):
            time.sleep(max(float(s.get("sleep", 0)) for s in specs))
        for spec in specs:
            if spec.get("fail_after") == part and "prediction_error" in spec:
                message = f"{spec.get('name')} refused after {part} parts"
                raise PredictionException(message, spec["prediction_error"])
            if spec.get("fail_after") == part:
                raise RuntimeError(f"{spec.get('name')} failed after {part} parts")
        live = {i: context.request_ids[i] for i, s in enumerate(specs) if part < s.get("parts", 0)}
        ret = [f"{s.get('name')}:{part};" for s in specs]
        send_intermediate_predict_response(
            ret, live, "Intermediate Prediction success", 200, context
        )
    return [f"{s.get('name')}:end" for s in specs]
