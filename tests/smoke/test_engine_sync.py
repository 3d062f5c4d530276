"""The loop tells the generation engine after every optimizer phase that the weights changed
(``GenerationEngine.sync``), so an engine holding its own copy of the weights (vLLM) can never sample
from stale ones; the HF engine counts the versions. A resumed run continues the count."""

import pytest
import torch

import rallyrl
from rallyrl.rollout import HFEngine
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke


def test_sync_after_every_update_with_the_new_weights(tiny_model, tmp_path, monkeypatch):
    seen = []
    real = HFEngine.sync

    def sync(self, policy):
        w = policy.lm.get_input_embeddings().weight
        seen.append((self.version, w.detach().clone()))
        real(self, policy)

    initial = []
    real_init = HFEngine.__init__

    def init(self, policy, *a, **k):
        real_init(self, policy, *a, **k)
        initial.append((self.version, policy.lm.get_input_embeddings().weight.detach().clone()))

    monkeypatch.setattr(HFEngine, "sync", sync)
    monkeypatch.setattr(HFEngine, "__init__", init)
    rallyrl.train(base_config(tiny_model, tmp_path / "run", train={"iterations": 3}))
    assert [v for v, _ in initial] == [0] and [v for v, _ in seen] == [0, 1, 2]
    # each sync comes after an update: the weights it announces differ from the ones before
    before = [initial[0][1]] + [w for _, w in seen[:-1]]
    assert all(not torch.equal(a, b) for a, b in zip(before, [w for _, w in seen]))


def test_a_resumed_run_continues_the_version_count(tiny_model, tmp_path, monkeypatch):
    versions = []
    real_init = HFEngine.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        versions.append(self.version)

    kw = dict(train={"iterations": 2}, checkpoint={"interval": 1, "keep_last": 2})
    rallyrl.train(base_config(tiny_model, tmp_path / "run", **kw))
    monkeypatch.setattr(HFEngine, "__init__", init)
    cfg = base_config(tiny_model, tmp_path / "run", **kw)
    cfg["train"] |= {"iterations": 3, "resume": "latest"}
    rallyrl.train(cfg)
    assert versions == [2]  # built after resuming from step_2: two optimizer phases behind its weights
