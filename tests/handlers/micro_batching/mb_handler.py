"""TorchServe's micro-batching example handler, in shape: an ``ImageClassifier`` whose
``handle`` is a ``MicroBatching`` set up from the model config's ``micro_batching`` section.
Its ``preprocess`` logs which micro-batch it got, and in which thread."""

import logging
import threading

from ts.handler_utils.micro_batching import MicroBatching
from ts.torch_handler.image_classifier import ImageClassifier

logger = logging.getLogger(__name__)


class MicroBatchingHandler(ImageClassifier):
    def __init__(self):
        mb_handle = MicroBatching(self)
        self.handle = mb_handle

    def initialize(self, ctx):
        super().initialize(ctx)
        config = ctx.model_yaml_config.get("micro_batching", {})
        parallelism = config.get("parallelism", None)
        if parallelism:
            logger.info(f"Setting micro batching parallelism from model_config_yaml: {parallelism}")
            self.handle.parallelism = parallelism
        self.handle.micro_batch_size = config.get("micro_batch_size", 1)

    def preprocess(self, data):
        logger.info(
            "micro-batch %s of %d requests in %s",
            self.handle.get_micro_batch_idx(),
            len(data),
            threading.current_thread().name,
        )
        return super().preprocess(data)
