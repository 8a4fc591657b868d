"""Every hook signature the hooks style accepts, one per stage of a pipeline of null drivers.

Each hook appends what it received to ``trace``; ``ctx`` carries ``order`` from stage to stage.
"""

PARAMS = {}


def init_hook(**params):
    PARAMS.update(params)


def _traced(value, entry):
    value = dict(value)
    value["trace"] = [*value.get("trace", []), entry]
    return value


def pre0(inputs):
    return _traced(inputs, "pre0(inputs)")


def pre1(inputs, ctx):
    ctx.order.append("pre1")
    return _traced(inputs, "pre1(inputs, ctx)")


def pre2(inputs, **kwargs):
    return _traced(inputs, f"pre2(inputs, **{sorted(kwargs)})")


def pre3(inputs, ctx, **kwargs):
    ctx.order.append("pre3")
    return _traced(inputs, f"pre3(inputs, ctx, **{sorted(kwargs)})")


def pre4(inputs, ctx, driver):
    ctx.order.append("pre4")
    return _traced(inputs, f"pre4(inputs, ctx, driver={type(driver).__name__})")


def post0(outputs, ctx, **kwargs):
    ctx.order = ["post0"]
    return _traced(outputs, f"post0(outputs, ctx, **{sorted(kwargs)})")


def post1(outputs, **kwargs):
    return _traced(outputs, f"post1(outputs, **{sorted(kwargs)})")


def post3(outputs, ctx):
    ctx.order.append("post3")
    outputs = _traced(outputs, "post3(outputs, ctx)")
    outputs["order"] = ctx.order
    outputs["request_id"] = ctx.request_id
    return outputs


def post4(outputs):
    outputs = _traced(outputs, "post4(outputs)")
    outputs["params"] = {k: PARAMS[k] for k in sorted(PARAMS) if k != "model_dir"}
    outputs["model_dir_set"] = bool(PARAMS.get("model_dir"))
    return outputs


preprocess = [pre0, pre1, pre2, pre3, pre4]
postprocess = [post0, post1, None, post3, post4]
