"""gen-remote: the generation interface over HTTP.

``create_generation_backend({"backend": "remote", "remote_cfg": {"base_url": URL}})`` gives a
trainer the ``generate``, ``generate_async``, ``score``, weight updates (``Refitter``,
``WeightBroadcaster``), versions and typed errors of the backend a gen-serve server runs at URL,
with nothing installed beyond gen-interface and httpx.
"""

from importlib.metadata import PackageNotFoundError, version

from gen_remote.backend import RemoteGeneration
from gen_remote.config import REMOTE_CFG_DEFAULTS, RemoteConfig, RemoteSettings
from gen_remote.server import ServerInfo

try:
    __version__ = version("gen-remote")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "REMOTE_CFG_DEFAULTS",
    "RemoteConfig",
    "RemoteGeneration",
    "RemoteSettings",
    "ServerInfo",
    "__version__",
]
