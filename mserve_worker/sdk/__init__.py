"""The handler SDK: what a handler imports, and one adapter module per handler style.

Runs inside worker processes, in each model's own environment: standard library only at import
time (torch, numpy and Pillow are imported by the handlers that need them, when they load).
Handlers written for other servers change only their import line to these modules:

=========================================  ===============================================
they imported                              import instead
=========================================  ===============================================
``ts.torch_handler.base_handler``          ``mserve_worker.sdk.base_handler``
``ts.torch_handler.image_classifier``      ``mserve_worker.sdk.image_classifier``
``ts.torch_handler.text_classifier``       ``mserve_worker.sdk.text_classifier``
``ts.torch_handler.image_segmenter``       ``mserve_worker.sdk.image_segmenter``
``ts.torch_handler.object_detector``       ``mserve_worker.sdk.object_detector``
``redhareapi`` (``Kernel``)                ``mserve_worker.sdk.kernel``
``mlrun.serving.v2_serving``               ``mserve_worker.sdk.v2_model`` (or ``.v2_serving``)
=========================================  ===============================================

Hooks files import nothing: their functions are found by name (see :mod:`.hooks`; the drivers
they run around are in :mod:`.drivers`). The adapter of a style is the module the loader imports
for it (``kernel``, ``hooks``, ``v2_model``); each defines ``claims(target)`` and
``load(target, module, context) -> LoadedHandler``. docs/handlers.md is the user's guide.
"""

# Handler names a user can give to --handler without shipping code; each is a module here.
# archiver.handler_spec.BUILTIN_HANDLERS must name the same set (a test checks it).
BUILTIN_HANDLERS = ("image_classifier", "image_segmenter", "object_detector", "text_classifier")
