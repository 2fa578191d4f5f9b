"""``trl``: an agl backend that trains with TRL's GRPO trainer machinery while agl runs the step loop.

:mod:`agl_backend_trl.plugin` registers it; :mod:`agl_backend_trl.config` holds its ``trl`` config
section (TRL ``GRPOConfig`` keys, each honoured or refused by name); :mod:`agl_backend_trl.trainer`
is TRL's ``GRPOTrainer`` with agl's loss; :mod:`agl_backend_trl.backend` is the loop backend.
docs/trl-backend.md says what is kept, replaced and refused, and why agl owns the loop.
"""

__all__: list[str] = []
