"""An ``async def handle`` module function (TorchServe's async worker contract): its
initialisation call (``data=None``) and every batch are awaited. Each answer says whether it ran
on an event loop and how many of its batch's calls were awaiting at once (the body's ``wait``:
seconds to sleep on the loop)."""

import asyncio

from ts.utils.util import PredictionException

STATE = {"initialised": False, "awaiting": 0, "most": 0}


async def handle(data, context):
    if data is None:
        await asyncio.sleep(0)
        STATE["initialised"] = True
        return None
    body = data[0].get("body") or {}
    if body.get("fail"):
        raise PredictionException(body["fail"], 418)
    STATE["awaiting"] += 1
    STATE["most"] = max(STATE["most"], STATE["awaiting"])
    try:
        await asyncio.sleep(float(body.get("wait", 0)))
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
        }
        for i, row in enumerate(data)
    ]
