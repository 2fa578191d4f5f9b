"""What serves the policy to agents: the engine contract, the in-process policy server, a real vLLM
server, and the process helpers they share.

May import ``agl_core.data``, ``agl_core.config`` and the shared helpers; never a stage, a source or a backend.
"""
