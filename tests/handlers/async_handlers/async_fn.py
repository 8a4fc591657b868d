"""An ``async def handle`` module function (TorchServe's async worker contract): its
initialisation call (``data=None``) and every batch are awaited. Each answer says whether it ran
on an event loop and how many of its batch's calls were awaiting at once (the body's ``wait``:
seconds to sleep on the loop; ``until``: wait, up to 20 s, until that many calls have been
awaiting at once, which only batches run concurrently reach; ``stream``: that many chunks,
awaiting between them; ``hang``: sleep that long, counting a cancellation in the answers'
``cancelled``)."""

import asyncio

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.utils.util import PredictionException

STATE = {"initialised": False, "awaiting": 0, "most": 0, "cancelled": 0}


async def handle(data, context):
    if data is None:
        await asyncio.sleep(0)
        STATE["initialised"] = True
        return None
    body = data[0].get("body") or {}
    if body.get("fail"):
        raise PredictionException(body["fail"], 418)
    if body.get("hang"):  # until its caller leaves: the coroutine is cancelled then
        try:
            await asyncio.sleep(float(body["hang"]))
        except asyncio.CancelledError:
            STATE["cancelled"] += 1
            raise
        return [{"echo": body.get("x"), "cancelled": STATE["cancelled"]}]
    if body.get("stream"):  # TorchServe's async vLLM handler streams this way
        for k in range(int(body["stream"])):
            piece = f"{body.get('x')}.{k};"
            send_intermediate_predict_response([piece], context.request_ids, "", 200, context)
            await asyncio.sleep(0.05)
        return [f"{body.get('x')}.end"]
    STATE["awaiting"] += 1
    STATE["most"] = max(STATE["most"], STATE["awaiting"])
    try:
        await asyncio.sleep(float(body.get("wait", 0)))
        deadline = asyncio.get_running_loop().time() + 20
        while STATE["most"] < int(body.get("until", 0)):
            if asyncio.get_running_loop().time() > deadline:
                raise PredictionException(f"only {STATE['awaiting']} calls awaiting", 504)
            await asyncio.sleep(0.01)
    finally:
        STATE["awaiting"] -= 1
    loop = asyncio.get_running_loop()
    return [
        {
            "echo": (row.get("body") or {}).get("x"),
            "initialised": STATE["initialised"],
            "on_loop": loop.is_running(),
            "request_id": context.get_request_id(i),
            "most_awaiting": STATE["most"],
            "cancelled": STATE["cancelled"],
        }
        for i, row in enumerate(data)
    ]
