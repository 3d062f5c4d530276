"""Validation of reward-function outputs: every rule has its own message, naming the sample."""

import math

import numpy as np
import pytest
import torch

from rallyrl.reward import RewardError, RewardStep, NamedRewardFn, Samples, validate_rewards
from rallyrl.reward.validate import RewardValidationError

LENGTHS = [3, 1, 4, 2, 2, 5, 3]  # output tokens of 7 samples


def check(out, lengths=LENGTHS, offset=0):
    return validate_rewards(out, lengths, fn_name="reward function 'f'", offset=offset)


def test_accepts_lists_tensors_arrays_and_dense():
    assert check([1, 2.5, 0, -1, 3, 4, 5]) == [1.0, 2.5, 0.0, -1.0, 3.0, 4.0, 5.0]
    assert check(torch.arange(7)) == [float(i) for i in range(7)]
    assert check(np.arange(7, dtype=np.float32))[3] == 3.0
    assert check([np.float32(0.5), torch.tensor(1.0), np.array(2.0), 3, 4, 5, 6])[:3] == [0.5, 1.0, 2.0]
    dense = check([[1, 2, 3], [0.5], [], 7, torch.tensor([1.0, 2.0]), np.ones(5), (1, 1, 1)])
    assert dense[0] == [1.0, 2.0, 3.0] and dense[2] == [] and dense[3] == 7.0 and dense[5] == [1.0] * 5


def test_one_reward_per_sample():
    with pytest.raises(RewardValidationError, match=r"expected 7 rewards, got 6$"):
        check([0.0] * 6)
    with pytest.raises(RewardValidationError, match=r"expected 7 rewards, got 8"):
        check(torch.zeros(8))


def test_not_a_list():
    with pytest.raises(RewardValidationError, match=r"returned NoneType; expected a list of 7 rewards"):
        check(None)
    with pytest.raises(RewardValidationError, match=r"returned float; expected a list of 7 rewards"):
        check(1.0)
    with pytest.raises(RewardValidationError, match=r"returned str"):
        check("0123456")
    with pytest.raises(RewardValidationError, match=r"array of shape \(7, 3\); expected 7 rewards"):
        check(torch.zeros(7, 3))


def test_dense_no_longer_than_the_output():
    with pytest.raises(RewardValidationError,
                       match=r"sample 3: dense reward has 3 values but the output has only 2 tokens"):
        check([0, 0, 0, [1, 2, 3], 0, 0, 0], lengths=[3, 1, 4, 2, 2, 5, 3])


def test_numbers_only():
    with pytest.raises(RewardValidationError, match=r"sample 2: expected a number, got str '0.5'"):
        check([0, 0, "0.5", 0, 0, 0, 0])
    with pytest.raises(RewardValidationError, match=r"sample 1: expected a number, got bool True"):
        check([0, True, 0, 0, 0, 0, 0])
    # None is a whole sample's "unscorable" (TRL's convention): kept as None, never one token's value
    assert check([None, 1, None, 0, 0, 0, 0]) == [None, 1.0, None, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(RewardValidationError, match=r"sample 3 token 1: expected a number, got None \(None means "
                                                    r"unscorable and stands for a whole sample's reward"):
        check([0, 0, 0, [1.0, None], 0, 0, 0])
    with pytest.raises(RewardValidationError, match=r"sample 4: expected a number, got a tensor of shape \(2, 2\)"):
        check([0, 0, 0, 0, torch.zeros(2, 2), 0, 0])
    with pytest.raises(RewardValidationError, match=r"sample 0 token 1: expected a number, got str 'x'"):
        check([[1, "x"], 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_finite_names_the_sample(bad):
    with pytest.raises(RewardValidationError, match=rf"sample 5: reward is {bad} \(rewards must be finite\)"):
        check([0, 0, 0, 0, 0, bad, 0])
    with pytest.raises(RewardValidationError, match=rf"sample 2 token 3: reward is {bad}"):
        check([0, 0, [0, 0, 0, bad], 0, 0, 0, 0])
    with pytest.raises(RewardValidationError, match=rf"sample 6: reward is {bad}"):
        check(torch.tensor([0, 0, 0, 0, 0, 0, bad]))


def test_offset_gives_the_index_in_the_whole_batch():
    """In a micro-batch starting at sample 6 of the chunk round, the 2nd sample is sample 7."""
    with pytest.raises(RewardValidationError, match=r"sample 7: reward is nan"):
        check([0.0, math.nan], lengths=[1, 1], offset=6)


def test_step_validates_every_micro_batch_before_returning():
    """Through the step (world size 1): a NaN in the 3rd micro-batch is a RewardError naming global
    sample 7 and the function; nothing is returned."""
    def fn(samples, prompts, outputs, **kw):
        return [math.nan if p == "p7" else 0.0 for p in prompts]

    s = Samples([f"p{i}" for i in range(9)], ["o"] * 9, [[1]] * 9, [{}] * 9)
    for placement in ("main", "local", "collective"):
        with pytest.raises(RewardError, match=r"on rank 0: RewardValidationError: reward function 'fn': "
                                              r"sample 7: reward is nan") as e:
            RewardStep([NamedRewardFn("fn", fn)], placement, batch_size=3)(s)
        assert e.value.error_type == "RewardValidationError"
