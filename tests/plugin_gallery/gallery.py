"""Run agl's contract suites on the gallery's plugins and their planted bugs; report what each catches.

``AGL_GALLERY_EXAMPLES=N python -m tests.plugin_gallery.gallery`` prints, per contract, how many planted bugs
the contract catches with the declarations alone and with a reference too (the author's slow
reference, hand-computed cases, a sink's reader, a hook's expected request), and which test
caught each. The correct plugins must pass every test: a contract that fails them is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import Phase, settings

# The contracts' settings objects are made when agl_core.testing is imported and take the profile
# loaded then: the gallery's profile (no shrinking: the first failure is enough) comes first.
EXAMPLES = int(os.environ.get("AGL_GALLERY_EXAMPLES", "30"))
settings.register_profile(
    "agl-gallery", max_examples=EXAMPLES, database=None, deadline=None, phases=[Phase.explicit, Phase.generate]
)
if __name__ == "__main__":
    settings.load_profile("agl-gallery")

from agl_core import AdvantageSettings, hookimpl  # noqa: E402 (after the profile)
from agl_core.testing.contracts import (  # noqa: E402 (after the profile)
    AdvantageEstimatorContract,
    AggregatorContract,
    HookContract,
    MetricSinkContract,
    PolicyLossContract,
)
from agl_core.testing.estimator_contract import EstimatorCase  # noqa: E402 (after the profile)
from agl_core.testing.lookup import contract_manager  # noqa: E402 (after the profile)
from tests.plugin_gallery import plugins as g  # noqa: E402 (after the profile)

# Tests that need what only a reference gives (the others run on declarations alone).
REFERENCE_TESTS = frozenset(
    {
        "test_matches_the_reference",
        "test_hand_computed_cases",
        "test_every_step_once_in_order_flushed_by_close",
        "test_a_resumed_run_records_each_step_once",
        "test_enqueue_matches_the_reference",
    }
)


def registering(hook_name: str, name: str, obj: Any) -> Any:
    """A plugin object whose ``hook_name`` registers ``obj`` as ``name``."""

    def register_it(self, register):
        register(name, obj)

    register_it.__name__ = hook_name
    return type(f"Gallery_{name}", (), {hook_name: hookimpl(register_it)})()


def read_csv(self, context):
    return g.read_csv_sink(context)


def expected_tagged(self, request):
    return g.expected_tagged(request)


LOO_CASE = EstimatorCase(
    # shaped rewards 1 - 0.1, 0 - 0.2, 0.5 - 0.05; each minus the mean of the other two
    {"g": [(1.0, 10), (0.0, 20), (0.5, 5)]},
    {"g": [0.775, -0.875, 0.1]},
    AdvantageSettings(norm_adv_by_std=False),
)

# kind -> (contract base, the correct plugin, its bugs, contract class attributes for a plugin object)
KINDS: dict[str, tuple[type, Any, dict[str, Any], Callable[[Any], dict[str, Any]]]] = {
    "aggregator (windowed, last K calls)": (
        AggregatorContract,
        g.windowed(),
        g.AGGREGATOR_BUGS,
        lambda fn: {
            "aggregator_name": "windowed",
            "plugins": (registering("agl_register_aggregators", "windowed", fn),),
            "leaves_calls_out": True,
            "trained_calls": g.windowed_trained_calls,
            "reference": g.windowed_reference,
        },
    ),
    "estimator (leave-one-out, length penalty)": (
        AdvantageEstimatorContract,
        g.loo_length(),
        g.ESTIMATOR_BUGS,
        lambda fn: {
            "estimator_name": "loo_length",
            "plugins": (registering("agl_register_advantage_estimators", "loo_length", fn),),
            "family": "leave_one_out",
            "length_penalty": True,
            "reference": g.loo_length_reference,
            "cases": (LOO_CASE,),
        },
    ),
    "policy loss (GSPO sequence ratio)": (
        PolicyLossContract,
        g.gspo(),
        g.LOSS_BUGS,
        lambda fn: {
            "loss_name": "gspo",
            "plugins": (registering("agl_register_policy_losses", "gspo", fn),),
            "ratio_level": "sequence",
            "reference": g.gspo_reference,
        },
    ),
    "metric sink (CSV)": (
        MetricSinkContract,
        g.CsvSink,
        g.SINK_BUGS,
        lambda cls: {
            "sink_name": "csv",
            "plugins": (registering("agl_register_metric_sinks", "csv", cls),),
            "read_back": read_csv,
        },
    ),
    "lifecycle hook (tagging)": (
        HookContract,
        g.Tagging(),
        g.HOOK_BUGS,
        lambda plugin: {"plugin": plugin, "expected_request": expected_tagged},
    ),
}


def contract_tests(base: type) -> list[str]:
    """The suite's tests, those that run on declarations alone first."""
    names = sorted(name for name in dir(base) if name.startswith("test_"))
    return [n for n in names if n not in REFERENCE_TESTS] + [n for n in names if n in REFERENCE_TESTS]


def run_contract(base: type, attributes: dict[str, Any], label: str, stop_at_first: bool) -> dict[str, str]:
    """The tests of ``base`` on the plugin ``attributes`` describe: test name -> pass | skip | the
    first line of the failure (``setup: ...`` when the plugin cannot even be looked up). With
    ``stop_at_first``, stop at the first failure of the declarations-only tests, else at the first
    failure of the reference tests (a bug caught once is caught)."""
    cls = type(f"Test_{label}", (base,), attributes)
    instance = cls()
    outcomes: dict[str, str] = {}
    try:
        if isinstance(instance, HookContract):
            contract_manager([instance.plugin], instance.plugin_settings)
        else:
            instance.plugin_under_test()
    except Exception as exc:  # noqa: BLE001 (any setup failure is the contract catching the bug)
        return {"setup": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    for name in contract_tests(base):
        if stop_at_first and caught_by(outcomes, with_reference=name in REFERENCE_TESTS):
            break
        try:
            getattr(instance, name)()
            outcomes[name] = "pass"
        except pytest.skip.Exception:
            outcomes[name] = "skip"
        except Exception as exc:  # noqa: BLE001
            outcomes[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    return outcomes


def caught_by(outcomes: dict[str, str], with_reference: bool) -> list[str]:
    return [
        name
        for name, outcome in outcomes.items()
        if outcome not in ("pass", "skip") and (with_reference or name not in REFERENCE_TESTS)
    ]


def run_gallery(kinds: Sequence[str] | None = None, progress: bool = False) -> dict[str, Any]:
    """The contracts on every correct plugin (every test) and every planted bug (until caught):
    {kind: {"correct": outcomes, "bugs": {bug: outcomes}}}, under the hypothesis profile loaded when
    agl_core.testing was imported (``python -m``: ``agl-gallery``, ``AGL_GALLERY_EXAMPLES`` examples)."""
    report: dict[str, Any] = {}
    for kind, (base, correct, bugs, attributes) in KINDS.items():
        if kinds is not None and kind not in kinds:
            continue
        report[kind] = {"correct": run_contract(base, attributes(correct), "correct", stop_at_first=False), "bugs": {}}
        for i, (bug, variant) in enumerate(bugs.items()):
            report[kind]["bugs"][bug] = run_contract(base, attributes(variant), f"bug{i}", stop_at_first=True)
            if progress:
                print(
                    f"{kind}: {bug}: {caught_by(report[kind]['bugs'][bug], True) or 'missed'}",
                    file=sys.stderr,
                    flush=True,
                )
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        "| contract | planted bugs | caught, declarations only | caught, with a reference |",
        "| --- | --- | --- | --- |",
    ]
    totals = [0, 0, 0]
    for kind, entry in report.items():
        bugs = entry["bugs"]
        without = sum(1 for o in bugs.values() if caught_by(o, False))
        with_ref = sum(1 for o in bugs.values() if caught_by(o, True))
        lines.append(f"| {kind} | {len(bugs)} | {without} | {with_ref} |")
        totals = [totals[0] + len(bugs), totals[1] + without, totals[2] + with_ref]
    n, a, b = totals
    lines.append(f"| **all** | {n} | {a} ({100 * a / n:.0f}%) | {b} ({100 * b / n:.0f}%) |")
    return "\n".join(lines)


def details(report: dict[str, Any]) -> str:
    lines = []
    for kind, entry in report.items():
        failing = [name for name, outcome in entry["correct"].items() if outcome not in ("pass", "skip")]
        lines.append(
            f"\n{kind}: the correct plugin {'passes every test' if not failing else 'FAILS ' + ', '.join(failing)}"
        )
        for bug, outcomes in entry["bugs"].items():
            without, with_ref = caught_by(outcomes, False), caught_by(outcomes, True)
            where = ", ".join(name.removeprefix("test_") for name in with_ref) or "no test failed"
            lines.append(
                f"  - {bug}: "
                f"{'caught' if without else ('caught with the reference' if with_ref else 'missed')} ({where})"
            )
    return "\n".join(lines)


def failures(report: dict[str, Any], caught_at_least: float) -> list[str]:
    """What the gallery claims and the report does not show: every correct plugin passes, and the
    contracts with a reference catch at least ``caught_at_least`` of the planted bugs."""
    found = [
        f"{kind}: the correct plugin fails {name}"
        for kind, entry in report.items()
        for name, outcome in entry["correct"].items()
        if outcome not in ("pass", "skip")
    ]
    bugs = [outcomes for entry in report.values() for outcomes in entry["bugs"].values()]
    caught = sum(1 for outcomes in bugs if caught_by(outcomes, with_reference=True))
    if caught < caught_at_least * len(bugs):
        found.append(f"{caught} of {len(bugs)} planted bugs caught with a reference, under {caught_at_least:.0%}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="AGL_GALLERY_EXAMPLES sets the examples per property (30)"
    )
    parser.add_argument("--kind", action="append", choices=list(KINDS), help="only this plugin kind (repeatable)")
    parser.add_argument(
        "--caught-at-least",
        type=float,
        default=0.9,
        metavar="FRACTION",
        help="exit 1 unless the contracts with a reference catch this share of the planted bugs (0.9)",
    )
    args = parser.parse_args(argv)
    report = run_gallery(args.kind, progress=True)
    print(table(report))
    print(details(report))
    found = failures(report, args.caught_at_least)
    for line in found:
        print(f"FAILED: {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
