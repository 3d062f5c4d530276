"""Fast checks of the randomwalks example task (no model training)."""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from examples.randomwalks import task  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    # Hand-built graph, goal 'a':
    #   b -> a            shortest from b: "ba"   = 2 nodes
    #   c -> b, c -> d    shortest from c: "cba"  = 3 nodes
    #   d -> c, d -> a    shortest from d: "da"   = 2 nodes
    #   a -> b is given but dropped: the goal is absorbing.
    return task.Graph(
        nodes=["a", "b", "c", "d"],
        adjacency={"a": {"b"}, "b": {"a"}, "c": {"b", "d"}, "d": {"c", "a"}},
    )


def test_tiny_graph_shortest(tiny):
    assert tiny.adjacency["a"] == set()
    assert tiny.shortest == {"a": 1, "b": 2, "d": 2, "c": 3}
    assert tiny.starts == ["b", "c", "d"]


def test_optimality_by_hand(tiny):
    m = task.MAX_LENGTH  # 10
    # shortest paths score 1
    assert task.optimality(tiny, "b", "a") == 1.0
    assert task.optimality(tiny, "c", "ba") == 1.0
    assert task.optimality(tiny, "d", "a") == 1.0
    # "cda": 3 nodes, shortest from c is 3 -> (10-3)/(10-3) = 1 (another shortest path)
    assert task.optimality(tiny, "c", "da") == 1.0
    # "dcba": 4 nodes, shortest from d is 2 -> (10-4)/(10-2) = 6/8
    assert task.optimality(tiny, "d", "cba") == pytest.approx(6 / 8)
    # "cdcda": 5 nodes, shortest from c is 3 -> (10-5)/(10-3) = 5/7
    assert task.optimality(tiny, "c", "dcda") == pytest.approx(5 / 7)
    # "dcdcdcdcda": 10 nodes, reaches the goal at the limit -> (10-10)/8 = 0
    walk = "dc" * 4 + "da"
    assert len(walk) == m
    assert task.walk_status(tiny, walk) == "ok"
    assert task.optimality(tiny, walk[0], walk[1:]) == 0.0
    # prompt/output split does not matter, only prompt + output
    assert task.optimality(tiny, "dc", "ba") == task.optimality(tiny, "d", "cba")


@pytest.mark.parametrize(
    "walk, status",
    [
        ("", "empty"),
        ("ca", "bad_edge"),  # no edge c -> a
        ("bb", "bad_edge"),  # no self loops
        ("cx", "bad_char"),
        ("c ba", "bad_char"),  # no spaces allowed
        ("C", "bad_char"),
        ("c", "unfinished"),
        ("cdc", "unfinished"),
        ("dc" * 5, "unfinished"),  # 10 nodes, goal not reached
        ("dc" * 5 + "ba", "too_long"),  # 12 nodes: past the limit
        ("bab", "after_goal"),  # trailing characters after the goal are an error
        ("baa", "after_goal"),
    ],
)
def test_invalid_walks_score_zero(tiny, walk, status):
    assert task.walk_status(tiny, walk) == status
    assert not task.is_valid_walk(tiny, walk)
    assert task.optimality(tiny, walk[:1], walk[1:]) == 0.0


def test_default_graph_deterministic_and_reaches_goal():
    g1 = task.build_graph()
    g2 = task.build_graph(task.DEFAULT_SEED)
    assert g1.adjacency == g2.adjacency and g1.seed == g2.seed
    assert g1.nodes == list("abcdefghijklmnopqrstu")
    assert g1.goal == "a" and g1.adjacency["a"] == set()
    for u in g1.starts:
        assert g1.adjacency[u], u  # has an out-edge
        assert u not in g1.adjacency[u]
        assert 2 <= g1.shortest[u] < task.MAX_LENGTH  # reaches 'a', denominator > 0
    assert task.default_graph().adjacency == g1.adjacency


def test_rejection_redraws_deterministically():
    # some seed in a short range gets rejected; build_graph then moves to a later seed
    rejected = [s for s in range(1000, 1030) if task.build_graph(s).seed != s]
    assert rejected
    s = rejected[0]
    g = task.build_graph(s)
    assert g.seed > s
    assert task.build_graph(g.seed).adjacency == g.adjacency
    bad = task.make_graph(s)
    assert any(not bad.adjacency[u] or u not in bad.shortest for u in bad.starts) or max(
        bad.shortest.values()
    ) >= task.MAX_LENGTH


def test_random_walks():
    g = task.default_graph()
    walks = task.random_walks(g, 500, random.Random(0))
    assert walks == task.random_walks(g, 500, 0)  # deterministic in the seed
    assert len(walks) == 500
    for w in walks:
        assert w[0] != "a" and 2 <= len(w) <= task.MAX_LENGTH
        assert all(v in g.adjacency[u] for u, v in zip(w, w[1:]))
        assert w.endswith("a") or len(w) == task.MAX_LENGTH
        assert "a" not in w[:-1]
    statuses = {task.walk_status(g, w) for w in walks}
    assert statuses <= {"ok", "unfinished"} and len(statuses) == 2
    mean = sum(task.optimality(g, w[0], w[1:]) for w in walks) / len(walks)
    assert mean == pytest.approx(task.expected_random_walk_optimality(g), abs=0.06)


def test_prompts():
    g = task.default_graph()
    tp = task.train_prompts(g, 64, seed=3)
    assert tp == task.train_prompts(g, 64, seed=3) and len(tp) == 64
    assert set(tp) <= set(g.starts)
    ep = task.eval_prompts(g)
    assert len(ep) == 200 and len(ep) >= 200
    assert {u: ep.count(u) for u in set(ep)} == {u: 10 for u in g.starts}


def test_reward_and_metric_fn():
    g = task.default_graph()
    u = g.starts[0]
    best = u
    while best[-1] != "a":  # follow a shortest path
        best += min(g.adjacency[best[-1]], key=lambda v: g.shortest[v])
    prompts = [u, u, u]
    outputs = [best[1:], "", "?"]
    samples = [p + o for p, o in zip(prompts, outputs)]
    r = task.reward_fn(samples, prompts, outputs, output_token_ids=None, tokenizer=None, extra=[1, 2, 3])
    assert r == [1.0, 0.0, 0.0]
    m = task.metric_fn(samples, prompts, outputs)
    assert list(m) == ["optimality"] and m["optimality"] == r
    # pinned on the default graph (seed 1246): m->a is an edge (S=2); m->l->d->a is
    # 4 nodes -> (10-4)/(10-2) = 0.75; a trailing node after the goal -> 0
    assert task.reward_fn(["ma", "mlda", "mldab"], ["m"] * 3, ["a", "lda", "ldab"]) == [1.0, 0.75, 0.0]


def test_core_tokenizer_roundtrip():
    from examples.randomwalks.tokenizer import build_core_tokenizer, vocab

    core = build_core_tokenizer()
    v = vocab()
    assert (v["<|pad|>"], v["<|eos|>"], v["<|unk|>"], v["a"], v["u"]) == (0, 1, 2, 3, 23)
    for s in ["a", "dkfa", "abcdefghijklmnopqrstu"]:
        ids = core.encode(s).ids
        assert ids == [v[c] for c in s]
        assert core.decode(ids + [v["<|eos|>"]], skip_special_tokens=True) == s
    assert core.encode("dk<|eos|>").ids == [v["d"], v["k"], v["<|eos|>"]]
    assert core.encode("d k").ids == [v["d"], v["<|unk|>"], v["k"]]


def test_tokenizer_roundtrip(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from examples.randomwalks.tokenizer import build_tokenizer

    tok = build_tokenizer()
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|eos|>"
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == 21 + 3
    for s in ["a", "dkfa", "abcdefghijklmnopqrstu", "uuu"]:
        ids = tok(s).input_ids
        assert len(ids) == len(s)  # one token per node, no BOS/EOS added
        assert tok.decode(ids, skip_special_tokens=True) == s
        assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == s
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2("dkfa").input_ids == tok("dkfa").input_ids
    assert tok2.decode(tok2("dkfa").input_ids) == "dkfa"
    assert (tok2.pad_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    tok2.padding_side = "left"
    batch = tok2(["d", "kfa"], padding=True)
    assert batch.input_ids[0] == [tok.pad_token_id] * 2 + tok("d").input_ids
    assert batch.attention_mask[0] == [0, 0, 1]


def test_prepare_fingerprint_stable():
    pytest.importorskip("transformers")
    from examples.randomwalks import prepare

    assert prepare.fingerprint(0) == prepare.fingerprint(0)
    assert prepare.fingerprint(0) != prepare.fingerprint(1)
    assert not prepare.is_prepared("/nonexistent/randomwalks")
