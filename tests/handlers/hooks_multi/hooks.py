# The seed's multiple-models hooks file, as written: lists of hooks, wrapped by a *args decorator.
# ruff: noqa: I001, UP031  (kept as the document writes it)
import logging


LOG = logging.getLogger(__name__)


def log(func):
    def decorator(*args):
        LOG.info("Running %s..." % func.__name__)
        return func(*args)

    return decorator


def init_hook(**params):
    LOG.info("Got params:")
    LOG.info(params)


@log
def preprocess1(inputs):
    return inputs


@log
def preprocess2(inputs):
    return inputs


@log
def postprocess1(outputs):
    return outputs


@log
def postprocess2(outputs):
    return outputs


preprocess = [preprocess1, preprocess2]
postprocess = [postprocess1, postprocess2]
