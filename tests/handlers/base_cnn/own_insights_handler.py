"""An ImageClassifier subclass with its own explanations (TorchServe's documented pattern): its
get_insights is used, never the built-in's captum one."""

from mserve_worker.sdk.image_classifier import ImageClassifier


class OwnInsights(ImageClassifier):
    def get_insights(self, tensor_data, raw_data, target):
        return [{"own": True, "target": target, "shape": list(t.shape)} for t in tensor_data]
