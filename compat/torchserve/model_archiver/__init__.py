"""torch-model-archiver 0.12's Python API, over mserve's archiver.

``from model_archiver import ModelArchiver, ModelArchiverConfig`` and
``from model_archiver.model_packaging import generate_model_archive`` work as with TorchServe's
package; the archive written is the one ``torch-model-archiver`` (ours) writes for the same
arguments. Shipped by mserve-torchserve (compat/torchserve), never by mserve itself: it imports
``archiver`` and ``archiver`` never imports it (docs/archiver.md#python-api-model_archiver).
"""

from model_archiver.model_archiver import ModelArchiver
from model_archiver.model_archiver_config import ModelArchiverConfig
from model_archiver.model_archiver_error import ModelArchiverError
from model_archiver.version import __version__

__all__ = ["ModelArchiver", "ModelArchiverConfig", "ModelArchiverError", "__version__"]
