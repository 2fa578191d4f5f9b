"""agl: Agent Lightning's trainer side as a plugin system.

Plugin authors need only :data:`hookimpl` and the data model in :mod:`agl_core.data`.
"""

from agl_core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
