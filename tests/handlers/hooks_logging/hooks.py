# The seed's first hooks example, as written (it imports nothing from the serving product).
# ruff: noqa: I001  (kept as the document writes it)
import logging


LOG = logging.getLogger(__name__)


def init_hook(**params):
    LOG.info("Got params:")
    LOG.info(params)


def preprocess(inputs):
    """Does processing inputs before the model inference.

    For example, here we can do checks, change shape and other ops.

    :param inputs: dict containing input numpy arrays:
    {'input-name': <numpy array>}
    :type inputs: dict
    :return: processed inputs dict
    """
    LOG.info("Running preprocess...")
    return inputs


def postprocess(outputs):
    """Does processing outputs after the model inference.

    :param outputs: dict containing input numpy arrays:
    {'input-name': <numpy array>}
    :type outputs: dict
    :return: processed outputs dict
    """
    LOG.info("Running postprocess...")
    return outputs
