"""fedddp: a federated-learning research runtime on torch.distributed.

One rank per device trains the clients it owns; rank 0 aggregates the stacked flat client
vectors with a server rule (fedddp.strategies). Entry points: ``python -m fedddp CONFIG``, and
``fedddp.run(config, overrides, out_dir)`` from Python (docs/python_api.md).
"""

from .errors import ConfigError, DataError, DiskFullError, DivergenceError, PluginError, StalledError

__version__ = "0.1.0"
__all__ = ["run", "Result", "ConfigError", "DataError", "DivergenceError", "DiskFullError", "StalledError",
           "PluginError"]


def __getattr__(name: str):
    # fedddp.run and fedddp.Result import torch; ``import fedddp`` (and the CLI's start) need not.
    if name in ("run", "Result"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedddp' has no attribute {name!r}")
