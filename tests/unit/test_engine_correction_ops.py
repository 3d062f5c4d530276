"""ops.engine: the engine/trainer ratio, the correction weights (tis, token and sequence masks) and the
mismatch sums, against values computed by hand (written here, not taken from the code's output)."""

import math

import pytest
import torch

from rallyrl import ops

L2, L105, L3 = math.log(2.0), math.log(1.05), math.log(3.0)
# row 0: ratios 2, 0.5, 1.05 then padding; row 1: ratio 3, a hole (garbage), ratio 3, padding
TRAINER = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, 7.0, -1.0, 0.0]])
ENGINE = torch.tensor([[-1.0 - L2, -2.0 + L2, -0.5 - L105, float("nan")],
                       [-1.0 - L3, float("inf"), -1.0 - L3, float("nan")]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)


def _w(mode, **kw):
    return ops.engine_weights(TRAINER, ENGINE, MASK, mode, **kw)


def test_none_is_one_on_actions_only():
    assert _w("none").tolist() == [[1, 1, 1, 0], [1, 0, 1, 0]]


def test_truncated_importance_sampling():
    w = _w("tis", cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, 0.5, 1.05, 0.0], abs=1e-6)
    assert w[1].tolist() == pytest.approx([1.5, 0.0, 1.5, 0.0], abs=1e-6)  # the hole and the pad stay 0


def test_token_mask():
    assert _w("mask", bounds=(0.6, 1.9)).tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert _w("mask", bounds=(0.499, 2.001)).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    # the bounds are inclusive (exact ratios: log-probs whose difference is exactly log 2 in float64)
    t, e = torch.tensor([[0.0, 0.0]], dtype=torch.float64), torch.tensor([[-L2, L2]], dtype=torch.float64)
    assert ops.engine_weights(t, e, torch.ones(1, 2, dtype=torch.bool), "mask", bounds=(0.5, 2.0)).tolist() == [[1, 1]]
    assert _w("mask", bounds=(0.0, 3.5)).tolist() == [[1, 1, 1, 0], [1, 0, 1, 0]]


def test_sequence_mask_uses_the_geometric_mean_over_action_tokens():
    # row 0: (2 * 0.5 * 1.05) ** (1/3) = 1.0164 -> kept whole; row 1: (3 * 3) ** (1/2) = 3 (hole skipped) -> dropped
    assert _w("mask", bounds=(0.6, 1.9), level="sequence").tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    # row 1's mean ratio is 3 (its product 9): a bound of 3.01 keeps it, on its action tokens only
    assert _w("mask", bounds=(0.6, 3.01), level="sequence").tolist() == [[1, 1, 1, 0], [1, 0, 1, 0]]


def test_mismatch_sums():
    s = ops.engine_mismatch_sums(TRAINER[:1], ENGINE[:1], MASK[:1])
    assert s["tokens"] == 3 and s["outside"] == 2  # ratios 2 and 0.5 are outside [0.9, 1.1], 1.05 is not
    assert s["abs_diff_sum"] == pytest.approx(2 * L2 + L105, abs=1e-6)  # 1.435088
    assert s["abs_diff_max"] == pytest.approx(L2, abs=1e-6)
    both = ops.engine_mismatch_sums(TRAINER, ENGINE, MASK)
    assert both["tokens"] == 5 and both["outside"] == 4 and both["abs_diff_max"] == pytest.approx(L3, abs=1e-6)


def test_unknown_modes_are_refused():
    with pytest.raises(ValueError, match="correction"):
        _w("icepop")
    with pytest.raises(ValueError, match="level"):
        _w("mask", level="batch")
