"""Per-request hooks for the batch test: a request can ask its preprocess to fail."""


def preprocess(inputs, ctx):
    if "fail" in inputs:
        raise ValueError(f"asked to fail: {inputs['fail'].tolist()}")
    ctx.doubled = (inputs["x"] * 2).tolist()
    return inputs


def postprocess(outputs, ctx):
    return {
        "x": outputs["x"],
        "doubled": ctx.doubled,
        "batch_count": ctx.batch_count,
        "request_id": ctx.request_id,
    }
