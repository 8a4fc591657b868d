"""TorchServe's deprecated ``ts.protocol.otf_message_handler``, for the one name handlers import
from it: ``send_intermediate_predict_response`` (the rest is TorchServe's own wire codec, which
mserve does not speak)."""

from mserve_worker.streaming import send_intermediate_predict_response

__all__ = ["send_intermediate_predict_response"]
