"""The per-call overheads removed after the ``floors`` benchmark (benchmarks/README.md), each held to
the same results as before:

- one process or DDP without a loss scaler: ``dist`` calls torch directly instead of accelerate's
  ``backward`` / ``clip_grad_norm_`` / optimizer wrapper (``dist.accelerator._is_plain``), to the same bits: the
  gradient norm, the clipped gradients and the optimizer step;
- ``rollout.pad`` in one torch call; ``quiet_generate``'s logging filter; the cached ``logits_to_keep``
  check of ``causal_forward``."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from rallyrl import dist
from rallyrl.rollout.hf import quiet_generate
from rallyrl.models.causal import _takes_logits_to_keep
from rallyrl.rollout import pad


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _step(use_accelerate: bool, max_norm: float, seed: int) -> tuple[float, list[torch.Tensor]]:
    """One backward + clip + fused AdamW step, through accelerate's wrappers or through ``dist``'s plain path."""
    from accelerate import Accelerator

    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(32, 7, generator=g), torch.randn(32, 5, generator=g)
    loss = ((model(x) - y) ** 2).mean() * 10.0 ** (seed % 5)  # norms from ~0.1 to ~1e4
    if use_accelerate:
        acc = Accelerator(cpu=True)
        model, opt = acc.prepare(model, opt)
        acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), max_norm)
    else:
        loss.backward()
        norm = dist.accelerator._clip_grad_norm(list(model.parameters()), max_norm)
    opt.step()
    return norm, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("max_norm", [float("inf"), 1.0, 0.05, 1e6])
@pytest.mark.parametrize("seed", range(6))
def test_plain_path_is_bit_identical_to_accelerate(max_norm, seed):
    norm_a, params_a = _step(True, max_norm, seed)
    norm_b, params_b = _step(False, max_norm, seed)
    assert torch.equal(norm_a, norm_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


def test_plain_clip_without_gradients_is_zero_and_touches_nothing():
    model = _model(0)
    assert float(dist.accelerator._clip_grad_norm(list(model.parameters()), 1.0)) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_one_cpu_process_takes_the_plain_path_and_keeps_a_torch_optimizer():
    from accelerate import Accelerator

    assert dist.accelerator._is_plain(Accelerator(cpu=True))
    dist.init_accelerator(60.0)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    wrapped, opt2 = dist.prepare(model, opt)
    assert opt2 is opt and wrapped is model  # no AcceleratedOptimizer: its per-call Python is gone


def test_pad_matches_the_row_by_row_definition():
    seqs = [[5, 6, 7], [], [8], [1, 2, 3, 4]]
    for left in (True, False):
        ids, mask = pad(seqs, 0, left=left)
        assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape == (4, 4)
        for row, m, x in zip(ids.tolist(), mask.tolist(), seqs):
            pads = [0] * (4 - len(x))
            assert row == (pads + x if left else x + pads)
            assert m == ([False] * len(pads) + [True] * len(x) if left else [True] * len(x) + [False] * len(pads))
    ids, mask = pad([], 0, left=True)
    assert ids.shape == mask.shape == (0, 0)


def test_quiet_generate_drops_warnings_but_not_errors_and_leaves_the_logger_as_it_was(caplog):
    log = logging.getLogger("transformers.modeling_utils")
    level, filters = log.level, list(log.filters)

    class LM:
        def generate(self, **kw):
            log.warning("a warning generate() would print")
            log.error("an error")
            return kw["input_ids"]

    with caplog.at_level(logging.WARNING, logger="transformers.modeling_utils"):
        quiet_generate(LM(), torch.zeros(1, 1), torch.ones(1, 1))
    assert [r.getMessage() for r in caplog.records] == ["an error"]
    assert log.level == level and log.filters == filters


def test_logits_to_keep_check_is_per_forward_function():
    class Keeps(nn.Module):
        def forward(self, input_ids, logits_to_keep=0):
            return input_ids

    class DoesNot(nn.Module):
        def forward(self, input_ids):
            return input_ids

    assert _takes_logits_to_keep(Keeps.forward) and not _takes_logits_to_keep(DoesNot.forward)
    assert _takes_logits_to_keep(Keeps().forward.__func__) is _takes_logits_to_keep(Keeps.forward)
