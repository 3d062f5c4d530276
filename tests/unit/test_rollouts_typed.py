"""Rollouts.from_chunk / Rollouts.concat: chunks of different widths merge with one mask convention."""

import torch

from rallyrl.reward.step import Reward
from rallyrl.rollout import Episodes, Rollouts, Scored, pad

PAD = 9


def _chunk(queries, responses, scores, dense=None, first=0):
    q, qm = pad(queries, PAD, left=True)
    r, rm = pad(responses, PAD, left=False)
    T = r.shape[1]
    g = Episodes(q, qm, r, rm, rm, responses, [f"o{i}" for i in range(len(responses))])
    lp = torch.arange(len(responses) * T, dtype=torch.float32).view(len(responses), T) * rm
    s = Scored(logprobs=lp, ref_logprobs=-lp, values=lp / 10)
    rewards = [Reward(sc, dense[i] if dense else None) for i, sc in enumerate(scores)]
    return Rollouts.from_chunk(g, s, rewards, [f"p{i}" for i in range(len(responses))],
                               [{} for _ in responses], list(range(first, first + len(responses))))


def test_pad_left_and_right():
    ids, mask = pad([[1, 2, 3], [4]], PAD, left=True)
    assert ids.tolist() == [[1, 2, 3], [PAD, PAD, 4]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    ids, mask = pad([[1, 2, 3], [4]], PAD, left=False)
    assert ids.tolist() == [[1, 2, 3], [4, PAD, PAD]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_concat_realigns_queries_left_and_widens_responses_right():
    a = _chunk([[1, 2]], [[5, 6, 7]], [1.0])
    b = _chunk([[3], [1, 2, 3, 4]], [[8], [8, 8]], [2.0, 3.0], dense=[[0.5], None], first=1)
    ro = Rollouts.concat([a, b], PAD)
    assert ro.query_ids.tolist() == [[PAD, PAD, 1, 2], [PAD, PAD, PAD, 3], [1, 2, 3, 4]]
    assert ro.query_mask.sum(1).tolist() == [2, 1, 4]
    assert ro.response_ids.tolist() == [[5, 6, 7], [8, PAD, PAD], [8, 8, PAD]]
    assert ro.response_mask.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    # per-token tensors are zero on padding, scores keep their order, dense scores exist for all rows
    assert ro.logprobs.tolist() == [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [2.0, 3.0, 0.0]]
    assert ro.scores.tolist() == [1.0, 2.0, 3.0]
    assert ro.dense_scores.tolist() == [[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert ro.total_rewards().tolist() == [1.0, 2.5, 3.0]
    assert ro.global_index == [0, 1, 2] and ro.prompts == ["p0", "p0", "p1"]


def test_concat_without_dense_scores_keeps_none():
    ro = Rollouts.concat([_chunk([[1]], [[2]], [1.0]), _chunk([[1]], [[2, 3]], [0.0])], PAD)
    assert ro.dense_scores is None and len(ro) == 2
