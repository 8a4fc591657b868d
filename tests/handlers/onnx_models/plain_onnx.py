"""A ``BaseHandler`` subclass that overrides nothing: its default steps run the ONNX model."""

from ts.torch_handler.base_handler import BaseHandler


class PlainOnnx(BaseHandler):
    pass
