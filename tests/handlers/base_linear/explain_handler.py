"""A BaseHandler subclass that adds explanations: gradient x input for the target class."""

from mserve_worker.sdk.base_handler import BaseHandler


class GradientExplainer(BaseHandler):
    def get_insights(self, tensor_data, raw_data, target):
        inputs = tensor_data.clone().requires_grad_(True)
        self.model(inputs)[:, target].sum().backward()
        return (inputs.grad * inputs).detach().tolist()
