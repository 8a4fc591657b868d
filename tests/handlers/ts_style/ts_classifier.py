"""TorchServe's documented pattern, unedited: subclass the built-in ImageClassifier from
``ts.torch_handler.image_classifier`` and change one thing (three classes per answer)."""

from ts.torch_handler.image_classifier import ImageClassifier


class TopThree(ImageClassifier):
    def initialize(self, context):
        super().initialize(context)
        self.set_max_result_classes(3)
