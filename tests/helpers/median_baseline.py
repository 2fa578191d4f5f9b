"""A third-party advantage estimator, ``median_baseline``, as a plugin registers one in code."""

from __future__ import annotations

import numpy as np

from agl_core import hookimpl, rollout_level


def median_baseline(rows, settings):
    """Each rollout's reward minus its group's median reward."""
    return rollout_level(rows, "median_baseline", 2, lambda rewards: rewards - np.median(rewards))


class MedianBaseline:
    """A third-party estimator plugin, registered in code."""

    @hookimpl
    def agl_register_advantage_estimators(self, register):
        register("median_baseline", median_baseline)
