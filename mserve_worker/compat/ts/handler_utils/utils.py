"""TorchServe's ``ts.handler_utils.utils``: ``send_intermediate_predict_response`` streams a
chunk of a request's response now (see ``mserve_worker.streaming``)."""

from mserve_worker.streaming import send_intermediate_predict_response

__all__ = ["send_intermediate_predict_response"]
