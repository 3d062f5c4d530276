"""Sampling through the HF engine in one call, as the rollout stage does (tests and benchmarks)."""

from __future__ import annotations

from typing import Any

import torch

from rallyrl.rollout import Episodes, HFEngine, Sampled, SamplingSpec, run_episodes


def generate(policy: Any, tokenizer: Any, query_ids: list[list[int]], gen: Any, do_sample: bool,
             device: torch.device, scored: bool = False) -> Episodes:
    """One chunk round's single-turn episodes (``rollout.logprobs_from: generate`` when ``scored``)."""
    engine = HFEngine(policy, tokenizer, device, gen.prefill_once)
    return run_episodes(engine, tokenizer, query_ids, SamplingSpec.of(gen, do_sample, tokenizer, logprobs=scored))


def sample(policy: Any, tokenizer: Any, rows: list[list[int]], prefill_once: bool = False, **spec: Any) -> Sampled:
    """``HFEngine.generate`` on ``rows`` with a spec of ``spec`` (no stop token unless given)."""
    engine = HFEngine(policy, tokenizer, torch.device("cpu"), prefill_once=prefill_once)
    with engine.ready():
        return engine.generate(rows, SamplingSpec(**spec))
