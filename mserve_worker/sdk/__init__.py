"""The handler SDK: what a handler imports, and one adapter module per handler style.

Runs inside worker processes, in each model's own environment: standard library only at import
time (torch, numpy and Pillow are imported by the handlers that need them, when they load).
Handlers written for TorchServe need no edit: their ``ts.*`` imports resolve to these modules
through ``mserve_worker/compat/ts``. Kernel files and mlrun model classes need none either: where
the model's environment lacks the real package, ``mserve_worker.stand_ins`` resolves

=========================================  ===============================================
their import                               to
=========================================  ===============================================
``redhareapi`` (``Kernel``)                ``mserve_worker.sdk.kernel``
``mlrun.serving[.v2_serving]``             ``mserve_worker.sdk.v2_model``
=========================================  ===============================================

Hooks files import nothing: their functions are found by name (see :mod:`.hooks`; the drivers
they run around are in :mod:`.drivers`). The adapter of a style is the module the loader imports
for it (``kernel``, ``hooks``, ``v2_serving``); each defines ``claims(target)`` and
``load(target, module, context) -> LoadedHandler``. docs/handlers.md is the user's guide.
"""

# Handler names a user can give to --handler without shipping code; each is a module here.
# archiver.handler_spec.BUILTIN_HANDLERS must name the same set (a test checks it).
BUILTIN_HANDLERS = ("image_classifier", "image_segmenter", "object_detector", "text_classifier")
