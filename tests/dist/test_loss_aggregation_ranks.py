"""The loss-aggregation contract with REAL processes: the same 9 samples (lengths 1..6, one sample left
out of the loss as a dropped zero-std group would be) give the same gradient on 1, 2 and 3 processes
(samples split 9 / 5+4 / 3+3+3) and any micro-batch size, for every `ppo.loss_aggregation`, with the
KL-in-loss term and the entropy bonus on; and so do the policy-loss variants (GSPO's sequence ratio,
CISPO, the dual clip), on rollout log-probs moved away from the policy's so that their clips bind.

pytest launches this file as a torch.distributed.run worker (``python -m torch.distributed.run
--nproc_per_node N THIS_FILE OUT MODEL MICRO``); rank 0 saves the gradient of the first optimizer step
(after the DDP all-reduce, before the optimizer) for each mode.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
# the policy-loss variants: name -> (loss aggregation, ppo options); run on perturbed rollout log-probs
VARIANTS = {
    "gspo": ("seq_mean_token_mean", {"ratio_level": "sequence", "sequence_clip_range": 0.05,
                                     "sequence_clip_range_high": 0.05}),
    "cispo": ("token_mean", {"policy_loss": "cispo", "cispo_clip_low": 0.2, "cispo_clip_high": 0.2}),
    "dual_clip": ("token_mean", {"dual_clip": 1.2}),
}
N, MAX_NEW = 9, 6


def test_the_gradient_does_not_depend_on_the_split(tiny_model, tmp_path):
    import torch

    from tests.helpers.runs import ROOT, env

    layouts = [(1, 0), (2, 2), (3, 1)]  # (processes, micro_batch_size; 0 = the whole minibatch)
    for nproc, micro in layouts:
        out = tmp_path / f"w{nproc}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(Path(__file__).resolve()), str(out), str(tiny_model), str(micro)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for mode in (*MODES, *VARIANTS):
        one, *others = (torch.load(tmp_path / f"w{n}" / f"{mode}.pt") for n, _ in layouts)
        assert one["grad"].abs().max() > 0
        for other in others:
            # float32 rounding of differently padded batches (measured max |diff| 3.3e-7 against a largest
            # gradient entry of 0.38); a wrong normaliser would be off by a whole factor
            assert torch.allclose(other["grad"], one["grad"], rtol=1e-4, atol=2e-6), mode
            assert other["loss"] == pytest.approx(one["loss"], rel=1e-5), mode
            assert other["clipfrac"] == pytest.approx(one["clipfrac"], rel=1e-6), mode
    # the modes really differ (the test would not see a normaliser that ignored the mode)
    grads = [torch.load(tmp_path / "w1" / f"{m}.pt")["grad"] for m in MODES]
    assert not torch.allclose(grads[0], grads[1]) and not torch.allclose(grads[1], grads[2])
    # each variant's clip binds on some tokens but not all, so a variant that ignored its option would show
    for name in VARIANTS:
        assert 0 < torch.load(tmp_path / "w1" / f"{name}.pt")["clipfrac"] < 1, name


# ------------------------------------------------------------------------------------------------
# The worker (runs in each process)


def _worker(out: Path, model_path: str, micro: int) -> None:
    import torch

    from rallyrl import dist, ops
    from rallyrl.config import ModelConfig, PPOConfig, split_evenly
    from rallyrl.data import PromptSampler
    from rallyrl.models import load_models
    from rallyrl.reward.step import Reward
    from rallyrl.rollout import Advantages, Episodes, Rollouts, pad, score_tokens
    from rallyrl.learn.state import Learner, TrainState
    from rallyrl.trainer import ppo_update

    torch.set_num_threads(1)
    device = dist.init_accelerator(timeout_s=60)
    W, R = dist.world_size(), dist.rank()
    counts = split_evenly(N, W)
    mine = list(range(sum(counts[:R]), sum(counts[: R + 1])))
    g = torch.Generator().manual_seed(0)  # the same global samples on every rank and in every launch
    queries = [torch.randint(5, 60, (2 + i % 3,), generator=g).tolist() for i in range(N)]
    responses = [torch.randint(5, 60, (1 + i % MAX_NEW,), generator=g).tolist() for i in range(N)]
    seq_adv = torch.randn(N, generator=g)
    for mode in (*MODES, *VARIANTS):
        models = load_models(ModelConfig(path=model_path), seed=0, value_head=False, reference=True)
        aggregation, options = VARIANTS.get(mode, (mode, {}))
        ppo = PPOConfig(estimator="grpo", epochs=1, num_minibatches=1, micro_batch_size=micro or None,
                        loss_aggregation=aggregation, kl_in="loss", kl_estimator="k3", init_kl_coef=0.1,
                        entropy_coef=0.01, max_grad_norm=None, lr=1e-3, **options)
        learner = Learner.create(models.policy, ppo, total_steps=1)
        q, qm = pad([queries[i] for i in mine], 0, left=True)
        r, rm = pad([responses[i] for i in mine], 0, left=False)
        gen = Episodes(q, qm, r, rm, rm, [responses[i] for i in mine], ["" for _ in mine])
        scored = score_tokens(models.policy, models.reference, gen, 1.0, device)
        # a reference that differs from the policy, so the KL term has a gradient of its own
        scored.ref_logprobs = (scored.ref_logprobs - 0.1 * torch.arange(r.shape[1])) * rm
        if mode in VARIANTS:  # rollout log-probs off the policy's by +-0.4, by global sample and column
            shift = 0.4 * torch.sin(7.0 * torch.tensor(mine).unsqueeze(1) + torch.arange(r.shape[1]))  # (b, T)
            scored.logprobs = (scored.logprobs + shift) * rm
        ro = Rollouts.from_chunk(gen, scored, [Reward(0.0) for _ in mine], ["" for _ in mine], [{} for _ in mine],
                                 mine)
        keep = torch.tensor([i != 4 for i in mine]).unsqueeze(1)  # sample 4: out of the loss and its normaliser
        adv = Advantages(seq_adv[mine].unsqueeze(1) * rm, None, None, rm & keep)
        state = TrainState(0, ops.FixedKLController(0.1), ops.RunningMoments(), PromptSampler(N, 0),
                           torch.Generator().manual_seed(R))
        seen: dict = {}
        step = learner.optimizer.step

        def record(*a, **k):
            if not seen:
                params = [p for p in learner.model.parameters() if p.requires_grad]
                seen["grad"] = torch.cat([p.grad.detach().flatten() for p in params]).clone()
            return step(*a, **k)

        learner.optimizer.step = record
        upd = ppo_update(learner, ro, adv, state, ppo, 1.0, MAX_NEW, device)
        # each rank's part is normalised by the global count / W (DDP averages gradients over W ranks)
        loss, clipped, tokens = dist.all_reduce_sum(torch.tensor([upd["loss"], upd["clipfrac_tok"], upd["tokens"]],
                                                                 dtype=torch.float64)).tolist()
        if R == 0:
            torch.save({"grad": seen["grad"], "loss": loss / W, "clipfrac": clipped / tokens}, out / f"{mode}.pt")
    dist.shutdown()


if __name__ == "__main__":
    import os

    _worker(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    os._exit(0)
