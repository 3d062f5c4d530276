"""`rollout:`, `generation:` and `ppo:`: how samples are drawn and how the policy learns from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .fields import DTYPES, _f

# `generation.engine`: what samples the rollouts (rallyrl/rollout/engine.py; docs/engines.md).
ENGINES = ("hf", "vllm")


@dataclass
class RolloutConfig:
    num_rollouts: int = _f(64, "GLOBAL samples per iteration, split over the ranks as evenly as possible.", gt=0)
    samples_per_prompt: int = _f(
        1,
        "G: completions sampled per prompt. Each iteration draws `num_rollouts / G` prompts and samples G "
        "completions of each (a group; its members may sit on different ranks, no per-rank divisibility is "
        "needed). `ppo.estimator: grpo | rloo` need G >= 2. See docs/algorithms.md.",
        ge=1,
    )
    chunk_size: int = _f(16, "Per-rank generation batch; one central reward step per chunk round.", gt=0)
    logprobs_from: Literal["forward", "generate"] = _f(
        "forward",
        "Where each rollout's policy log-probs and values come from. `forward`: a separate policy forward "
        "over the sampled tokens after generation (the first PPO step's ratio is exactly 1). `generate`: "
        "the logits and final hidden states generate() computed while sampling (as TRL does): one policy "
        "forward less per chunk; equal to `forward`'s up to float rounding of the KV-cached math (~1e-5 "
        "in float32; more in bf16, where veRL and OpenRLHF recompute for that reason).",
    )
    max_episode_tokens: int | None = _f(
        None,
        "Multi-turn episodes (`env.factory`): the most tokens a training row's context may hold, prompt + every "
        "turn + the environment's messages (null = the model's positions; never more than them, nor than "
        "`generation.vllm.max_model_len` with the vLLM engine). A turn is cut where it would pass it; "
        "an environment reply that would not fit with room for one more token ends the episode as truncated "
        "(the reply is not shown). See docs/environments.md.",
        gt=0,
    )
    dynamic_sampling: bool = _f(
        False,
        "DAPO's dynamic sampling (`ppo.estimator: grpo | rloo`): keep drawing `num_rollouts / G` prompts and "
        "generating their groups until `num_rollouts / G` groups whose rewards are not all equal are collected (or "
        "`rollout.max_sampling_rounds` rounds are drawn; the batch is then filled with groups left out of the "
        "loss). The choice is global, the same for any number of processes and reward placement. "
        "See docs/algorithms.md.",
    )
    max_sampling_rounds: int = _f(
        10, "`rollout.dynamic_sampling`: at most this many rounds of `num_rollouts` samples per iteration.", ge=1
    )


@dataclass
class VLLMConfig:
    dtype: Literal[("auto", *DTYPES)] = _f(  # type: ignore[valid-type]
        "auto",
        "Dtype vLLM computes in: `auto` = `model.dtype` (the trainer's). `bfloat16` generates faster on a CPU "
        "with avx512_bf16 at a larger engine/trainer mismatch (docs/engines.md has the measured numbers).",
    )
    memory_fraction: float | None = _f(
        None,
        "vLLM's `gpu_memory_utilization` on a GPU: the share of the device's memory the engine may take for its "
        "weights and KV cache, beside the trainer on the same device. null = 0.3 (TRL's colocate default). Not "
        "read on CPU (there `kv_cache_gib` sizes the cache).",
        gt=0, le=1,
    )
    kv_cache_gib: float | None = _f(
        None,
        "KV-cache size in GiB (vLLM's `kv_cache_memory_bytes`). null = 1 GiB on CPU (vLLM's own default reserves "
        "a share of the machine's RAM per engine, and there is one engine per rank); on a GPU the cache is "
        "sized by `memory_fraction`.",
        gt=0,
    )
    max_model_len: int | None = _f(
        None, "Longest prompt + response the engine accepts, in tokens. null = the model's maximum position count. "
        "Also bounds a multi-turn episode's row (`rollout.max_episode_tokens`): vLLM refuses a longer context.",
        gt=0,
    )
    enforce_eager: bool | None = _f(
        None,
        "Run the model eagerly (no torch.compile / CUDA graphs). null = true on CPU (compiling costs minutes per "
        "start and each rank starts an engine), false on a GPU.",
    )
    probe_tolerance: float | None = _f(
        None,
        "After every weight push a fixed token sequence is scored by the engine and by the policy; the mean "
        "per-token log-prob difference must be at most this, else every rank stops with an `EngineError`. null = "
        "the measured default for the engine's (or a bf16 trainer's) dtype against a float32 trainer: 1e-3 for "
        "float32, 0.25 for bfloat16/float16 (docs/engines.md).",
        gt=0,
    )
    sync_timeout_s: float = _f(
        300.0, "Seconds a weight push (and its probe) may take on a rank before every rank stops with an "
               "`EngineError`.", gt=0,
    )


@dataclass
class GenerationConfig:
    max_new_tokens: int = _f(32, "Maximum response length in tokens.", gt=0)
    do_sample: bool = _f(True, "Sample (True) or decode greedily (False) during training rollouts.")
    temperature: float = _f(1.0, "Sampling temperature.", gt=0)
    top_k: int = _f(0, "Top-k filtering (0 = off).", ge=0)
    top_p: float = _f(1.0, "Nucleus filtering (1.0 = off).", gt=0, le=1)
    stop_sequences: list[str] = _f(
        [], "Strings that end a response: tokens after the one completing the string are dropped."
    )
    prefill_once: bool = _f(
        True,
        "Prefill each distinct prompt of a generation chunk once and expand its KV cache (seq2seq: its "
        "encoding) to the chunk's other copies of it (the G members of a group, `rollout.samples_per_prompt`), "
        "instead of prefilling every copy. Greedy decoding gives the same tokens and sampling the same "
        "distribution; generation is 1.39x faster at G = 8 with ~100-token prompts and 32 new tokens on "
        "SmolLM2-135M (docs/scaling.md). Chunks without a repeated prompt, one-token prompts and models "
        "whose cache cannot be expanded take the ordinary path.",
    )
    engine: Literal[ENGINES] = _f(  # type: ignore[valid-type]
        "hf",
        "What samples the rollouts (and eval): `hf` (transformers' `generate` on the policy's own weights: exact "
        "on-policy) or `vllm` (an in-process vLLM engine per rank, fed the policy's weights after every optimizer "
        "phase and checked by a probe; causal LMs; needs vLLM installed). See docs/engines.md.",
    )
    vllm: VLLMConfig = field(default_factory=VLLMConfig,
                             metadata={"doc": "`generation.engine: vllm` settings (below)."})


@dataclass
class PPOConfig:
    epochs: int = _f(4, "PPO epochs over each iteration's rollouts.", gt=0)
    num_minibatches: int = _f(
        1, "Optimizer steps per epoch; every rank splits its samples into this many minibatches.",
        gt=0,
    )
    micro_batch_size: int | None = _f(
        None, "Samples per forward/backward within a minibatch (gradient accumulation); null = whole minibatch.",
        gt=0,
    )
    lr: float = _f(1e-5, "AdamW learning rate.", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "Learning-rate schedule over all optimizer steps of the run."
    )
    warmup_steps: int = _f(0, "Linear warm-up optimizer steps.", ge=0)
    max_grad_norm: float | None = _f(1.0, "Gradient clipping norm (null = off).", gt=0)
    estimator: Literal["gae", "grpo", "rloo"] = _f(
        "gae",
        "Advantage estimator: `gae` (PPO with a value head and GAE), `grpo` (group-normalised outcome reward, "
        "no value head) or `rloo` (leave-one-out baseline, no value head). See docs/algorithms.md.",
    )
    group_scale: Literal["group", "batch", "none"] = _f(
        "group",
        "`grpo`: divide the group-centred reward by the group's std (`group`, GRPO), the whole global batch's "
        "std (`batch`) or nothing (`none`, Dr. GRPO). Std = unbiased sample std.",
    )
    group_std_floor: float = _f(
        1e-4, "`grpo`: the std a centred reward is divided by is at least this (a near-constant group is not "
              "blown up).",
        gt=0,
    )
    drop_zero_std_groups: bool = _f(
        False,
        "`grpo`/`rloo`: leave groups whose rewards are all equal (advantage 0) out of the loss and its "
        "normaliser (DAPO's dynamic-sampling filter, without re-sampling).",
    )
    mask_truncated: bool = _f(
        False,
        "Leave responses that `generation.max_new_tokens` cut off (no EOS, no stop sequence) out of the loss and "
        "its normaliser (DAPO; TRL's `mask_truncated_completions`). They still count in the group statistics "
        "and in whitening: the baseline estimates the prompt's reward over everything the policy sampled.",
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = _f(
        "token_mean",
        "How per-token losses become the loss, over the GLOBAL minibatch: `token_mean` (sum / all tokens), "
        "`seq_mean_token_mean` (mean over sequences of each one's token mean) or `seq_mean_token_sum` (each "
        "sequence's token sum / `generation.max_new_tokens`, mean over sequences; Dr. GRPO).",
    )
    clip_range: float = _f(
        0.2, "PPO ratio clip epsilon (the lower side, and the upper one unless `clip_range_high`).", gt=0
    )
    clip_range_high: float | None = _f(
        None, "Upper ratio clip epsilon (DAPO's clip-higher): the ratio is clipped to "
              "[1 - clip_range, 1 + clip_range_high]; null = `clip_range`.",
        gt=0,
    )
    ratio_level: Literal["token", "sequence"] = _f(
        "token",
        "The importance ratio of the clipped loss: `token` (per token, PPO/GRPO) or `sequence` (GSPO: the "
        "sequence's length-normalised ratio `exp(mean over its action tokens of log(pi / pi_old))`, clipped to "
        "[1 - `ppo.sequence_clip_range`, 1 + `ppo.sequence_clip_range_high`]; pair it with `ppo.loss_aggregation: "
        "seq_mean_token_mean`, the GSPO paper's objective). See docs/algorithms.md.",
    )
    sequence_clip_range: float = _f(
        3e-4, "`ratio_level: sequence`: the lower clip epsilon of the sequence ratio (the GSPO paper's 3e-4; "
              "`ppo.clip_range` is the token ratio's and is not read then).",
        gt=0,
    )
    sequence_clip_range_high: float = _f(
        4e-4, "`ratio_level: sequence`: the upper clip epsilon of the sequence ratio (the GSPO paper's 4e-4).",
        gt=0,
    )
    policy_loss: Literal["ppo", "cispo"] = _f(
        "ppo",
        "`ppo`: the clipped surrogate (PPO/GRPO). `cispo` (MiniMax-M1): `-sg[clip(r, 1 - cispo_clip_low, 1 + "
        "cispo_clip_high)] * A * log pi` per token, the importance weight clipped and its gradient stopped, so "
        "no token leaves the gradient; `ppo.clip_range*` and `ppo.dual_clip` are not used. See docs/algorithms.md.",
    )
    cispo_clip_low: float | None = _f(
        None, "`policy_loss: cispo`: the weight is at least 1 - this; null = no lower bound (the paper's choice).",
        gt=0,
    )
    cispo_clip_high: float = _f(
        4.0, "`policy_loss: cispo`: the weight is at most 1 + this (4.0: at most 5, TRL's recommended "
             "`epsilon_high` 5.0 from the ScaleRL paper).",
        gt=0,
    )
    dual_clip: float | None = _f(
        None, "Dual-clip PPO (Ye et al. 2020): on tokens with a negative advantage the loss is capped at "
              "`-dual_clip * A` (veRL's `clip_ratio_c`, often 3); null = off.",
        gt=1, why="the cap -c * A must lie beyond the clipped loss",
    )
    clip_range_value: float = _f(0.2, "Value clip range around the rollout values.", gt=0)
    vf_coef: float = _f(0.1, "Value loss coefficient.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    gamma: float = _f(1.0, "Discount factor.", ge=0, le=1)
    lam: float = _f(0.95, "GAE lambda.", ge=0, le=1)
    init_kl_coef: float = _f(0.05, "Initial KL penalty coefficient (beta).", ge=0)
    target_kl: float | None = _f(
        None, "Target per-sequence KL for the adaptive controller (Ziegler et al.); null = fixed beta.",
        gt=0,
    )
    kl_horizon: int = _f(10000, "Horizon of the adaptive KL controller, in samples.", gt=0)
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k1", "Per-token KL estimator (in the reward or in the loss).")
    kl_in: Literal["reward", "loss"] = _f(
        "reward",
        "Where the KL to the reference goes: `reward` (`gae`: a per-token penalty in the reward; `grpo`/`rloo`: "
        "the sequence's KL times beta subtracted from its score before the group statistics) or `loss` "
        "(beta * KL added to the loss, aggregated as the policy loss; the GRPO way, usually with `k3`).",
    )
    whiten_advantages: bool = _f(
        True, "`gae` only: whiten advantages over the GLOBAL batch (all ranks). Critic-free advantages are used "
              "exactly as the estimator computes them."
    )
    reward_scaling: Literal["none", "running"] = _f(
        "none", "Divide scores by the running std of scores (global over ranks)."
    )
    reward_clip: float | None = _f(None, "Clip scores to [-x, x] after scaling (null = off).", gt=0)
    engine_correction: Literal["none", "tis", "mask"] = _f(
        "none",
        "Correction of the policy-gradient term for the difference between the engine that sampled "
        "(`generation.engine: vllm`) and the trainer's log-probs of the same weights, per action token with "
        "ratio r = exp(trainer - engine log-prob): `none`; `tis` (weight min(r, `engine_correction_cap`), "
        "truncated importance sampling); `mask` (weight 0 where r leaves [`engine_correction_low`, `engine_correction_high`], per token or "
        "per sequence: `engine_correction_level`). Needs `rollout.logprobs_from: forward`. docs/engines.md.",
    )
    engine_correction_cap: float = _f(2.0, "`tis`: the cap C of the weight min(r, C) (veRL's default 2.0).", gt=0)
    engine_correction_low: float = _f(
        0.5, "`mask`: a token (or sequence) whose ratio is below this is left out of the policy-gradient term "
             "(weight 0).", ge=0, lt=1,
    )
    engine_correction_high: float = _f(
        2.0, "`mask`: a token (or sequence) whose ratio is above this is left out of the policy-gradient term.",
        gt=1,
    )
    engine_correction_level: Literal["token", "sequence"] = _f(
        "token",
        "`mask`: `token` (each token's own ratio) or `sequence` (the geometric mean of a sequence's token "
        "ratios, exp(mean log r), decides for all its tokens: a product of ratios would explode with length).",
    )
    max_nonfinite_skips: int = _f(
        0,
        "Optimizer steps whose loss or gradient norm is NaN/inf that may be skipped (not applied, counted "
        "in `policy/nonfinite_skips`) before the run stops; 0 = the first one stops every rank with an error naming the "
        "iteration, the metric and the newest checkpoint.",
        ge=0,
    )

    @property
    def critic_free(self) -> bool:
        """``grpo``/``rloo``: no value head exists (no module, parameters, optimizer state, value loss)."""
        return self.estimator != "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether any KL to a reference can be non-zero; if not, no reference is built at all."""
        return self.init_kl_coef > 0 or self.target_kl is not None




def engine_logprobs_exact(gen: GenerationConfig, do_sample: bool) -> bool:
    """Whether vLLM can return the log-probs the trainer computes: of the full vocabulary at the sampling
    temperature. vLLM's are either raw (temperature 1, full vocabulary) or processed (temperature applied,
    but renormalised over what top-k / top-p kept: TRL #6789), so they match with no truncation, or at
    temperature 1 (docs/engines.md)."""
    truncated = gen.top_k > 0 or gen.top_p < 1.0
    return gen.temperature == 1.0 or (do_sample and not truncated)
