"""DAPO's dynamic sampling with real processes (gloo): the decision is global and exact.

- A/B/C: `rallyrl train` on 2 processes, 12 rollouts of 3 prompts x G = 4 (group 1 straddles the ranks),
  a 0/1 reward under `main`, `local` (a reward that moves the global RNGs) and `collective` (a reward
  sharded over the ranks): the same rounds, kept groups, rollouts and final weights, byte for byte.
- E: the run of A with checkpoints, SIGKILLed in its last iteration's sampling rounds and resumed: the same
  rollouts and weights as A (nothing but the prompt sampler's position, which is checkpointed, carries over).
- 1 vs 2 processes: this file as a torch.distributed.run worker drives the stages themselves with an
  engine whose samples depend only on (prompt, member, round), so both layouts see the same samples: the
  same groups are kept, each rank ends with the batch plan's share in global-index order, and the update
  gives the same weights (float32 summation order aside).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

G, N, MAX_NEW = 4, 12, 6
FN = "tests.helpers.rewards:"


def _cfg(model, run_dir, reward, **sections):
    from tests.helpers.runs import base_config

    return base_config(model, run_dir, rollout={"num_rollouts": N, "chunk_size": 4, "samples_per_prompt": G,
                                                "dynamic_sampling": True, "max_sampling_rounds": 3},
                       ppo={"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1, "num_minibatches": 2, "lr": 1e-2},
                       reward=reward, **{"train": {"iterations": 3}, **sections})


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    from tests.helpers.runs import rallyrl_train, write_config

    tmp = tmp_path_factory.mktemp("dyn")
    out = {}
    for name, reward in (("A", {"fn": FN + "hashed_pass_fail", "placement": "main", "batch_size": 5}),
                         ("B", {"fn": FN + "pass_fail_noisy", "placement": "local"}),
                         ("C", {"fn": FN + "pass_fail_sharded", "placement": "collective"})):
        proc = rallyrl_train(write_config(tmp / f"{name}.yaml", _cfg(tiny_model, tmp / name, reward)), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = tmp / name
    return out


def test_the_same_groups_are_kept_whatever_the_placement(runs):
    from rallyrl.tracking import read_jsonl

    weights = {k: (d / "final" / "model.safetensors").read_bytes() for k, d in runs.items()}
    assert weights["A"] == weights["B"] == weights["C"]
    rows = {k: read_jsonl(d / "rollouts.jsonl") for k, d in runs.items()}
    strip = lambda rs: [(r["step"], r["index"], r["group"], r["prompt"], r["output"], r["reward"], r["advantage"])  # noqa: E731
                        for r in rs]
    assert strip(rows["A"]) == strip(rows["B"]) == strip(rows["C"])
    metrics = {k: read_jsonl(d / "metrics.jsonl") for k, d in runs.items()}
    keys = ("rollout/sampling_rounds", "rollout/groups_discarded", "rollout/groups_unused", "rollout/short_groups")
    assert [[m[k] for k in keys] for m in metrics["A"]] == [[m[k] for k in keys] for m in metrics["C"]]
    # the run exercised the refill: some iteration needed more than one round and discarded groups
    assert any(m["rollout/sampling_rounds"] > 1 and m["rollout/groups_discarded"] > 0 for m in metrics["A"])


def test_every_trained_group_varies_and_straddles_ranks(runs):
    from rallyrl.tracking import read_jsonl

    rows = read_jsonl(runs["A"] / "rollouts.jsonl")
    metrics = read_jsonl(runs["A"] / "metrics.jsonl")
    for step, m in enumerate(metrics, 1):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["index"])
        assert [r["index"] for r in mine] == list(range(N)) and [r["group"] for r in mine] == [i // G for i in range(N)]
        assert [r["rank"] for r in mine] == [0] * 6 + [1] * 6  # the batch plan's even split, in index order
        kept = N // G - int(m["rollout/short_groups"])
        for g in range(N // G):
            members = [r for r in mine if r["group"] == g]
            assert len({r["prompt"] for r in members}) == 1
            varies = len({r["reward"] for r in members}) > 1
            assert varies == (g < kept)  # kept groups first, then (only in a short batch) fillers
            if not varies:
                assert all(r["advantage"] == 0 for r in members)


def test_resume_after_sigkill_in_the_sampling_rounds_is_bit_identical(runs, tiny_model, tmp_path):
    from safetensors.torch import load_file

    from rallyrl.tracking import read_jsonl
    from tests.helpers.runs import kill_when_paused, resume_latest, write_config

    calls = [int(m["reward/calls"]) for m in read_jsonl(runs["A"] / "metrics.jsonl")]  # rank 0's calls (main)
    cfg = _cfg(tiny_model, tmp_path / "E", {"fn": FN + "pass_fail_with_crashes", "placement": "main", "batch_size": 5},
               checkpoint={"interval": 1, "keep_last": 2})
    # pause (then kill every process) in the last call of iteration 3: after at least one sampling round of it
    cmd, e = kill_when_paused(write_config(tmp_path / "e.yaml", cfg), 2, tmp_path / "calls", pause_at=sum(calls))
    resume_latest(cmd, e)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (runs["A"], tmp_path / "E"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert read_jsonl(runs["A"] / "rollouts.jsonl") == read_jsonl(tmp_path / "E" / "rollouts.jsonl")


def test_one_and_two_processes_keep_the_same_groups_and_train_the_same(tiny_model, tmp_path):
    import torch

    from tests.helpers.runs import ROOT, env

    for nproc in (1, 2):
        out = tmp_path / f"w{nproc}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(Path(__file__).resolve()), str(out), str(tiny_model)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    one, two = (torch.load(tmp_path / f"w{n}" / "result.pt") for n in (1, 2))
    assert one["rows"] == two["rows"] and one["metrics"] == two["metrics"]  # samples, rewards, advantages: exact
    assert any(m["rollout/sampling_rounds"] > 1 for m in one["metrics"])
    assert any(m["rollout/short_groups"] > 0 for m in one["metrics"])  # a short batch, with fillers, too
    assert two["shares"] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]  # the plan's split, in index order
    # the first update's gradient: float32 rounding of a sum over 2 ranks instead of 1 (a wrong normaliser
    # or a different batch would be off by a whole factor)
    assert one["grad"].abs().max() > 0
    assert torch.allclose(one["grad"], two["grad"], rtol=1e-4, atol=2e-6)
    # after 3 iterations: AdamW turns rounding in near-zero gradient entries into steps of up to lr, so
    # the weights agree to a small fraction of how far they moved (measured: 6e-5 of a 3e-2 move)
    moved = (one["weights"] - one["initial"]).abs().max()
    assert moved > 0 and (one["weights"] - two["weights"]).abs().max() < 0.01 * moved


# ------------------------------------------------------------------------------------------------
# The worker (runs in each process)


class _IndexedEngine:
    """Answers prompt copy ``member`` of a group with ids that depend only on (prompt, member, round):
    one process and two see the same samples. A third of the prompts answer every member alike (a group
    with no spread). Calls come in chunk-round order and only the last rounds of a rank can be empty, so
    call ``c`` is chunk round ``c`` of ``shard``."""

    version = 0

    def __init__(self, shard, salt: str) -> None:
        self.shard, self.salt, self.calls = shard, salt, 0

    def ready(self):
        import contextlib

        return contextlib.nullcontext()

    def generate(self, prompts, spec):
        import hashlib

        from rallyrl.rollout import Sampled

        first = self.shard.first_index + self.calls * self.shard.chunk_size
        self.calls += 1
        out = []
        for j, p in enumerate(prompts):
            alike = hashlib.sha256(f"{p}".encode()).digest()[0] % 3 == 0
            member = 0 if alike else (first + j) % G
            h = hashlib.sha256(f"{p}|{member}|{self.salt}".encode()).digest()
            out.append([5 + b % 50 for b in h[1 : 2 + h[0] % MAX_NEW]])
        return Sampled(out, version=0)

    def sync(self, policy) -> None:
        pass


def _worker(out: Path, model_path: str) -> None:
    import torch

    from rallyrl import dist
    from rallyrl.config import load_config, make_batch_plan
    from rallyrl.inputs import PromptSet
    from rallyrl.learn.advantages import compute_advantages
    from rallyrl.learn.state import Learner, TrainState
    from rallyrl.learn.update import ppo_update
    from rallyrl.models import load_models
    from rallyrl.reward.step import NamedRewardFn, RewardStep
    from rallyrl.rollout import SamplingSpec, Shard, collect_rollouts
    from rallyrl.rollout.dynamic import sample_groups
    from tests.helpers.rewards import hashed_pass_fail

    torch.set_num_threads(1)
    device = dist.init_accelerator(timeout_s=60)
    W, R = dist.world_size(), dist.rank()
    cfg = load_config({"model": {"path": model_path}, "generation": {"max_new_tokens": MAX_NEW},
                       "rollout": {"num_rollouts": N, "chunk_size": 4, "samples_per_prompt": G,
                                   "dynamic_sampling": True, "max_sampling_rounds": 2},
                       "ppo": {"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1, "num_minibatches": 1,
                               "lr": 1e-2, "max_grad_norm": None}})
    plan = make_batch_plan(cfg, W)
    models = load_models(cfg.model, seed=0, value_head=False, reference=False)
    tok = models.tokenizer
    texts = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing",
             "my friend", "the rain", "a tree", "blue sky"]
    prompts = PromptSet([{"prompt": t} for t in texts], [tok(t)["input_ids"] for t in texts])
    learner = Learner.create(models.policy, cfg.ppo, total_steps=3)
    state = TrainState.fresh(cfg, len(texts), shuffle_seed=R)
    initial = torch.cat([p.detach().flatten() for p in learner.model.parameters()]).clone()
    first: dict = {}
    optimizer_step = learner.optimizer.step

    def record(*a, **k):  # the gradient of the first optimizer step (after the all-reduce)
        if not first:
            first["grad"] = torch.cat([p.grad.detach().flatten() for p in learner.model.parameters()]).clone()
        return optimizer_step(*a, **k)

    learner.optimizer.step = record
    step = RewardStep([NamedRewardFn("pf", hashed_pass_fail)], "main", tokenizer=tok)
    spec = SamplingSpec.of(cfg.generation, True, tok)
    rows, metrics, shares = [], [], []
    for it in range(3):
        rounds = []

        def draw() -> Shard:
            drawn = state.sampler.next(plan.prompts_per_iteration)
            prompts.prepare(drawn)
            return Shard.of_plan(plan, R, plan.sample_prompts(drawn))

        def collect(shard: Shard):
            rounds.append(shard)
            engine = _IndexedEngine(shard, f"{it}.{len(rounds)}")
            return collect_rollouts(models, engine, step, prompts, shard, spec, device)

        ro, _, m = sample_groups(draw, collect, plan, cfg.rollout.max_sampling_rounds, None, tok.pad_token_id)
        adv = compute_advantages(ro, state, cfg.ppo)
        ppo_update(learner, ro, adv, state, cfg.ppo, 1.0, MAX_NEW, device)
        mine = [(it, i, g, p, o, float(s), a, f) for i, g, p, o, s, a, f in zip(
            ro.global_index, ro.group, ro.prompts, ro.outputs, ro.scores.tolist(), adv.seq_advantages,
            ro.flags("filler").tolist())]
        gathered = dist.gather_objects(mine)
        ranks = dist.gather_objects(ro.global_index)
        if R == 0:
            rows += sorted(r for part in gathered for r in part)
            shares = ranks
            metrics.append({k: v for k, v in m.items() if k.startswith("rollout/")} | adv.stats)
    weights = torch.cat([p.detach().flatten() for p in learner.model.parameters()])
    if R == 0:
        torch.save({"rows": rows, "metrics": metrics, "shares": shares, "weights": weights, "initial": initial,
                    "grad": first["grad"]}, out / "result.pt")
    dist.shutdown()


if __name__ == "__main__":
    import os

    _worker(Path(sys.argv[1]), sys.argv[2])
    os._exit(0)
