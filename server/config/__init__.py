"""The server config: one typed object from defaults, a TorchServe properties file, a YAML file,
``MSERVE_*`` variables and flags.

Precedence, lowest to highest: built-in defaults < TorchServe's ``config.properties``
(``--ts-config`` or ``TS_CONFIG_FILE``; its ``TS_<KEY>`` variables when the file sets
``enable_envvars_config=true``; server/ts_config.py) < YAML file (``--config``) < environment
(``MSERVE_<KEY>``, e.g. ``MSERVE_JOB_QUEUE_SIZE=50``) < command-line flags. A later layer replaces
a key's whole value. Unknown keys are errors naming the key and where it came from (the
properties file warns instead, as TorchServe ignores them). Every listener binds to 127.0.0.1
unless told otherwise.

The package: :mod:`.server_config` (the settings and their defaults), :mod:`.loading` (the
layers, parsing and checks), :mod:`.entries` (TorchServe's per-model ``models`` and
``model_snapshot`` entries), :mod:`.addresses` (listener addresses) and :mod:`.model_settings`
(a model version's settings and the one table of their TorchServe names). It imports nothing of
the server above it: every layer reads its settings from here.
"""

from __future__ import annotations

from server.config.addresses import (
    ADDRESS_KEYS,
    GRPC_ADDRESS_KEYS,
    grpc_tls,
    parse_address,
    split_address,
)
from server.config.entries import ModelEntry, parse_model_entries
from server.config.loading import (
    ENV_PREFIX,
    TORCHSERVE_DEFAULTS,
    from_environ,
    load_config,
    load_yaml,
    read_yaml_mapping,
)
from server.config.model_settings import BATCH_WAITS
from server.config.server_config import DEFAULT_DENY, ServerConfig

__all__ = [
    "ADDRESS_KEYS",
    "BATCH_WAITS",
    "DEFAULT_DENY",
    "ENV_PREFIX",
    "GRPC_ADDRESS_KEYS",
    "TORCHSERVE_DEFAULTS",
    "ModelEntry",
    "ServerConfig",
    "from_environ",
    "grpc_tls",
    "load_config",
    "load_yaml",
    "parse_address",
    "parse_model_entries",
    "read_yaml_mapping",
    "split_address",
]
