# The seed's skip example (a face detector, then emotions on the faces), as written but for the
# seed's typo "returnt outputs".
def preprocess1(inputs):
    return inputs


def postprocess1(outputs, ctx):
    # if length of face boxes is 0 -> skip_next is True else False
    ctx.skip_next = len(outputs.get("face-boxes", [])) == 0

    return outputs


def preprocess2(inputs, ctx):
    if ctx.skip_next:
        inputs["ml-serving-ignore"] = True

    return inputs


def postprocess2(outputs, ctx):
    # Was skipped?
    if ctx.skip_next:
        # Nothing to return in case if skipped
        return {}

    return outputs


preprocess = [preprocess1, preprocess2]
postprocess = [postprocess1, postprocess2]
