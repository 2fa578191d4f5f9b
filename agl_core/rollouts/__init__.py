"""Where completed rollouts come from.

Shared by every source: ``source`` (the contract and request making), ``events`` (events into a
completed rollout) and ``finish`` (parse, lifecycle hooks, store what they wrote). The gateway family:
``gateway`` (picks sync or async), ``gateway_sync``, ``gateway_async``, ``gateway_client`` and
``retry``. The embedded family: ``embedded`` (the source), ``recorder`` (its local gateway stand-in)
and ``agents`` (agent classes and their per-thread environment).

May import ``agl_core.data``, ``agl_core.config``, ``agl_core.hookspecs``, ``agl_core.plugins`` and the
shared helpers; the gateway and embedded families never import each other, and no stage or backend.
"""
