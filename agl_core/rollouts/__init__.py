"""Where completed rollouts come from: the source contract, event parsing, the gateway client and
sources, and the embedded source.

May import ``agl_core.data``, ``agl_core.config``, ``agl_core.hookspecs``, ``agl_core.plugins`` and the
shared helpers; the gateway and embedded sources never import each other, and no stage or backend.
"""
