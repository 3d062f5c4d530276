"""Metric functions used by the tests (importable as `tests.helpers.metrics:NAME`)."""

from tests.helpers.rewards import deterministic_score


def coin(samples, prompts, outputs, **kwargs):
    """A pass/fail value that depends on exactly this (prompt, output) pair (values 0 and 1), plus a
    value outside [0, 1] (no @k metrics for it)."""
    return {"coin": [float(deterministic_score(p, o) > 0.5) for p, o in zip(prompts, outputs)],
            "chars": [float(len(o)) for o in outputs]}
