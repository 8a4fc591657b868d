"""Hooks around the pytorch driver: record the driver's kwargs on ctx, skip the model on ask."""


def preprocess(inputs, ctx, **kwargs):
    ctx.kwargs = sorted(kwargs)
    ctx.model_class = kwargs["model_class"].__name__
    ctx.training = kwargs["model"].training
    if "skip" in inputs:
        inputs = {k: v for k, v in inputs.items() if k != "skip"}
        inputs["ml-serving-ignore"] = True
    return inputs


def postprocess(outputs, ctx, model, **kwargs):
    outputs = dict(outputs)
    outputs["hook_kwargs"] = ctx.kwargs
    outputs["model_class"] = ctx.model_class
    outputs["training"] = ctx.training
    outputs["same_model"] = model is kwargs["driver"].model
    return outputs
