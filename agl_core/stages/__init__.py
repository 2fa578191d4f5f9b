"""The training stages between completed rollouts and the backend batch: aggregation, mismatch
classification, credit, losses, normalisation, shaping, tensorisation and the step pipeline.

May import ``agl_core.data``, ``agl_core.config``, ``agl_core.hookspecs`` and ``agl_core.plugins``; never a
rollout source, a serving module or a backend.
"""
