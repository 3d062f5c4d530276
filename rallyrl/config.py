"""Typed configuration: dataclasses, a strict loader and the derived batch plan.

Every field has a default and a one-line ``doc`` in its metadata; ``docs/config.md`` is generated from
these (``python -m rallyrl.config --markdown``) and a test keeps the two in sync.

Strictness is the point (style rule 4): an unknown key, or a value of the wrong type, is a
``ConfigError`` naming the dotted key (with a "did you mean" suggestion) and it is raised before any
model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent."""


# The dtypes a model can be loaded in: the one list (`model.dtype` and reward models read it). Names are
# torch attribute names, so `getattr(torch, name)` gives the dtype without this module importing torch.
DTYPES = ("float32", "bfloat16", "float16")


def _f(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with documentation attached (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


@dataclass
class LoraConfig:
    r: int = _f(8, "LoRA rank (`model.reference: lora`).")
    alpha: float = _f(16.0, "LoRA scaling numerator: the adapter's update is scaled by `alpha / r`.")
    dropout: float = _f(
        0.0,
        "peft's `lora_dropout`. Only 0 is accepted: rallyrl runs the policy with dropout off (as TRL/OpenRLHF "
        "PPO), so the rollout's log-probs and the first PPO step's agree; the key exists so peft/trlx configs port.",
    )
    target_modules: str | list[str] = _f(
        "all-linear",
        "Modules that get an adapter: `all-linear` (peft: every linear layer but the LM head; GPT-2's Conv1D "
        "layers included) or a list of module-name suffixes, e.g. `[q_proj, v_proj]` (Llama) or `[c_attn]` (GPT-2).",
    )
    merge_on_save: bool = _f(
        False,
        "Also write a merged model (adapter folded into the weights) to `final/`, loadable with plain "
        "`AutoModelForCausalLM.from_pretrained`; the adapter then goes to `final/adapter/`.",
    )


REFERENCES = ("copy", "shared", "lora")
# `train.report_to`: the experiment trackers rallyrl can log to (rallyrl/trackers.py), besides metrics.jsonl.
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


@dataclass
class ModelConfig:
    path: str = _f("", "Local Hugging Face model folder (config + weights + tokenizer) of the policy.")
    tokenizer_path: str | None = _f(None, "Tokenizer folder, if it is not `model.path`.")
    arch: Literal["causal", "seq2seq"] = _f(
        "causal",
        "Model type: `causal` (`AutoModelForCausalLM`, query and response as one sequence) or `seq2seq` "
        "(`AutoModelForSeq2SeqLM`, e.g. T5: the encoder reads the query, the decoder writes the response).",
    )
    prepare: str | None = _f(
        None,
        "Import path (`pkg.mod:attr` or `file.py:attr`) of `fn(path)`, called with `model.path` before the "
        "folder is checked, in every process: it builds or converts the model there on first use and must "
        "be safe to call concurrently and cheap once done (examples/sentiments converts SmolLM2 this way).",
    )
    dtype: Literal[DTYPES] = _f(  # type: ignore[valid-type]
        "float32", "Dtype the policy, reference and value head are loaded in."
    )
    value_head: Literal["linear", "mlp"] = _f(
        "linear", "Value head on the last hidden state: `linear` (as TRL) or `mlp` (H -> 2H -> 1, as trlx)."
    )
    value_head_std: float = _f(
        0.0, "Init std of the value head's last layer (0 = zeros, so the first values are 0)."
    )
    reference: Literal[REFERENCES] = _f(  # type: ignore[valid-type]
        "copy",
        "Reference policy of the KL penalty: `copy` (a full frozen copy), `shared` (only the top "
        "`model.num_layers_unfrozen` blocks train; the reference is a frozen copy of just those over the shared "
        "frozen trunk) or `lora` (a LoRA adapter trains; the reference is the model with the adapter disabled). "
        "See docs/models.md.",
    )
    num_layers_unfrozen: int = _f(
        2, "`model.reference: shared`: how many top transformer blocks train (1 .. the model's layer count)."
    )
    sharding: Literal["ddp", "fsdp"] = _f(
        "ddp",
        "How the policy, value head, reference and optimizer state are held across processes: `ddp` (every "
        "rank holds all of them; gradients are all-reduced) or `fsdp` (FSDP2: each transformer block and the "
        "rest are sharded over the ranks, each holding ~1/N; weights are gathered block by block in training "
        "and once per call for generation and rollout scoring; checkpoints are sharded with "
        "PyTorch's distributed checkpointing, DCP). The models are built empty and rank 0 alone reads the "
        "safetensors weights into every rank's shards (others: loaded whole first, with a note). Works with every "
        "`model.reference` (`shared` and `lora` run on the policy's own sharded weights, gathered with it for the "
        "reference pass). See docs/scaling.md.",
    )
    gradient_checkpointing: bool = _f(
        False,
        "Activation (gradient) checkpointing of the policy's transformer blocks: each block's activations are "
        "recomputed in the backward pass instead of kept, so the update's memory grows with one block's "
        "activations instead of all of them, for one more block forward per micro-batch. The same gradients "
        "(tested); generation and scoring (no gradients) are not affected. See docs/scaling.md.",
    )
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"doc": "`model.reference: lora` settings (below)."})


@dataclass
class DataConfig:
    prompts: str | list[Any] | None = _f(
        None,
        "Training prompts: a file (`.jsonl` of `{\"prompt\": str, ...metadata}`, `.json` holding a list of such "
        "objects, `.csv`, `.parquet`, or `.txt` with one prompt per line), a folder written by datasets' "
        "`save_to_disk`, a data set name for `datasets.load_dataset` (see `data.split`, `data.subset`; offline, "
        "only data sets in the local cache load), or an inline list (of strings or such dicts). Files and "
        "data sets are read as memory-mapped Arrow tables (docs/data.md). A prompt may also be a "
        "conversation, a list of `{\"role\", \"content\"}` messages, rendered with the tokenizer's chat "
        "template (docs/reward.md). `rallyrl.train(prompts=...)` overrides it.",
    )
    eval_prompts: str | list[Any] | None = _f(
        None, "Evaluation prompts, same forms as `data.prompts` (a data set: its `data.eval_split`); unset = no "
        "evaluation."
    )
    prompt_column: str = _f(
        "prompt", "The column that holds the prompts (renamed to `prompt`; a data set that also has a `prompt` "
        "column is an error). Every other column is metadata for the reward function."
    )
    split: str = _f("train", "The split of `data.prompts` when it is a data set name or a folder of several splits.")
    subset: str | None = _f(None, "The configuration (subset) of a data set name, e.g. `main` for `openai/gsm8k`.")
    eval_split: str = _f(
        "test", "The split of `data.eval_prompts` when it is a data set name or a folder of several splits."
    )
    shuffle: bool = _f(True, "Shuffle the prompt order each pass over the data (shared seed: all ranks agree).")


@dataclass
class TrainConfig:
    seed: int = _f(0, "Seed of everything (model init, prompt order; sampling is seeded per rank from it).")
    run_dir: str = _f("runs/default", "Run directory: config.yaml, metrics.jsonl, rollouts.jsonl, final/.")
    iterations: int = _f(10, "PPO iterations (collect `rollout.num_rollouts` samples, then update).")
    log_rollouts: bool = _f(True, "Write every training sample to `rollouts.jsonl`.")
    tensorboard: bool = _f(
        False, "Also log metrics to TensorBoard under `run_dir/tensorboard/`; the same as `report_to: [tensorboard]`."
    )
    report_to: Literal[TRACKERS] | list[Literal[TRACKERS]] = _f(  # type: ignore[valid-type]
        [],
        "Experiment trackers that also get the config and every iteration's metrics, from the main rank: one "
        "or a list of `tensorboard`, `wandb`, `mlflow`, `trackio` (each an extra: `pip install 'rallyrl[wandb]'`). "
        "`metrics.jsonl` is always written. Each honours its own environment variables (`WANDB_MODE`, "
        "`MLFLOW_TRACKING_URI`, ...). See docs/tracking.md.",
    )
    project: str | None = _f(
        None,
        "Tracker project (wandb project, mlflow experiment, trackio project); null = the tracker's own "
        "variable (`WANDB_PROJECT`, `MLFLOW_EXPERIMENT_NAME`, `TRACKIO_PROJECT`) or `rallyrl`.",
    )
    run_name: str | None = _f(
        None, "Tracker run name; null = `WANDB_NAME` (wandb) or the name of `train.run_dir`."
    )
    progress: bool = _f(
        True,
        "Show a progress bar on the main rank when stderr is a terminal. Each iteration's line is printed "
        "either way; when stderr is not a terminal (CI logs, `nohup`, a job scheduler) there is no bar.",
    )
    save_final: bool = _f(True, "Save the final policy (no value head) and tokenizer to `run_dir/final/`.")
    num_threads: int = _f(
        0, "torch intra-op threads per process (0 = `OMP_NUM_THREADS` when it is set, else cores / local processes)."
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = _f(
        "no",
        "Compute dtype of the forward and backward passes, generation and the reference pass: `no` (the stored "
        "dtype, `model.dtype`) or `bf16` (bfloat16 compute over float32 weights, gradient reduction and "
        "optimizer state: autocast under ddp, FSDP2's MixedPrecisionPolicy under fsdp; log-probs, KL, "
        "advantages and losses stay float32). `fp16` is refused (it needs a loss scaler). See docs/scaling.md.",
    )
    overwrite: bool = _f(
        False, "Start a fresh run in a `run_dir` that holds an earlier run, deleting its outputs."
    )
    resume: str | None = _f(
        None,
        "Resume from `latest` (newest valid checkpoint in `run_dir/checkpoints/`; an error if there is none), "
        "`auto` (the newest valid checkpoint if there is one, else a fresh start: one command for the first "
        "start and every restart of a pre-emptible job) or a checkpoint folder.",
    )
    allow_config_change: bool = _f(
        False,
        "On resume, accept a config that differs from the run's recorded one in settings that alter "
        "training (optimizer, PPO, rollout, generation, seed, model, reward, data). Without it such a "
        "change is refused with a `key: old -> new` list; with it every change takes effect from the "
        "resumed iteration and is appended to the run's history. `train.iterations`, logging and "
        "checkpoint intervals never need it.",
    )
    lock_run_dir: bool = _f(
        True,
        "Hold an exclusive lock on `run_dir/.lock` for the whole run (and during `rallyrl check`): a second "
        "job on the same `run_dir` is refused at once, before anything is written. Set it to false only on a "
        "file system without working locks (the error says so), and then make sure yourself that one job at "
        "a time uses the folder. See docs/troubleshooting.md.",
    )


@dataclass
class RolloutConfig:
    num_rollouts: int = _f(64, "GLOBAL samples per iteration, split over the ranks as evenly as possible.")
    samples_per_prompt: int = _f(
        1,
        "G: completions sampled per prompt. Each iteration draws `num_rollouts / G` prompts and samples G "
        "completions of each (a group; its members may sit on different ranks, no per-rank divisibility is "
        "needed). `ppo.estimator: grpo | rloo` need G >= 2. See docs/algorithms.md.",
    )
    chunk_size: int = _f(16, "Per-rank generation batch; one central reward step per chunk round.")
    logprobs_from: Literal["forward", "generate"] = _f(
        "forward",
        "Where each rollout's policy log-probs and values come from. `forward`: a separate policy forward "
        "over the sampled tokens after generation (the first PPO step's ratio is exactly 1). `generate`: "
        "the logits and final hidden states generate() computed while sampling (as TRL does): one policy "
        "forward less per chunk; equal to `forward`'s up to float rounding of the KV-cached math (~1e-5 "
        "in float32; more in bf16, where veRL and OpenRLHF recompute for that reason).",
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
        10, "`rollout.dynamic_sampling`: at most this many rounds of `num_rollouts` samples per iteration."
    )


@dataclass
class GenerationConfig:
    max_new_tokens: int = _f(32, "Maximum response length in tokens.")
    do_sample: bool = _f(True, "Sample (True) or decode greedily (False) during training rollouts.")
    temperature: float = _f(1.0, "Sampling temperature.")
    top_k: int = _f(0, "Top-k filtering (0 = off).")
    top_p: float = _f(1.0, "Nucleus filtering (1.0 = off).")
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


@dataclass
class PPOConfig:
    epochs: int = _f(4, "PPO epochs over each iteration's rollouts.")
    num_minibatches: int = _f(
        1, "Optimizer steps per epoch; every rank splits its samples into this many minibatches."
    )
    micro_batch_size: int | None = _f(
        None, "Samples per forward/backward within a minibatch (gradient accumulation); null = whole minibatch."
    )
    lr: float = _f(1e-5, "AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "Learning-rate schedule over all optimizer steps of the run."
    )
    warmup_steps: int = _f(0, "Linear warm-up optimizer steps.")
    max_grad_norm: float | None = _f(1.0, "Gradient clipping norm (null = off).")
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
              "blown up)."
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
    clip_range: float = _f(0.2, "PPO ratio clip epsilon (the lower side, and the upper one unless `clip_range_high`).")
    clip_range_high: float | None = _f(
        None, "Upper ratio clip epsilon (DAPO's clip-higher): the ratio is clipped to "
              "[1 - clip_range, 1 + clip_range_high]; null = `clip_range`."
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
              "`ppo.clip_range` is the token ratio's and is not read then)."
    )
    sequence_clip_range_high: float = _f(
        4e-4, "`ratio_level: sequence`: the upper clip epsilon of the sequence ratio (the GSPO paper's 4e-4)."
    )
    policy_loss: Literal["ppo", "cispo"] = _f(
        "ppo",
        "`ppo`: the clipped surrogate (PPO/GRPO). `cispo` (MiniMax-M1): `-sg[clip(r, 1 - cispo_clip_low, 1 + "
        "cispo_clip_high)] * A * log pi` per token, the importance weight clipped and its gradient stopped, so "
        "no token leaves the gradient; `ppo.clip_range*` and `ppo.dual_clip` are not used. See docs/algorithms.md.",
    )
    cispo_clip_low: float | None = _f(
        None, "`policy_loss: cispo`: the weight is at least 1 - this; null = no lower bound (the paper's choice)."
    )
    cispo_clip_high: float = _f(
        4.0, "`policy_loss: cispo`: the weight is at most 1 + this (4.0: at most 5, TRL's recommended "
             "`epsilon_high` 5.0 from the ScaleRL paper)."
    )
    dual_clip: float | None = _f(
        None, "Dual-clip PPO (Ye et al. 2020): on tokens with a negative advantage the loss is capped at "
              "`-dual_clip * A` (> 1; veRL's `clip_ratio_c`, often 3); null = off."
    )
    clip_range_value: float = _f(0.2, "Value clip range around the rollout values.")
    vf_coef: float = _f(0.1, "Value loss coefficient.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(0.95, "GAE lambda.")
    init_kl_coef: float = _f(0.05, "Initial KL penalty coefficient (beta).")
    target_kl: float | None = _f(
        None, "Target per-sequence KL for the adaptive controller (Ziegler et al.); null = fixed beta."
    )
    kl_horizon: int = _f(10000, "Horizon of the adaptive KL controller, in samples.")
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
    reward_clip: float | None = _f(None, "Clip scores to [-x, x] after scaling (null = off).")
    max_nonfinite_skips: int = _f(
        0,
        "Optimizer steps whose loss or gradient norm is NaN/inf that may be skipped (not applied, counted "
        "in `policy/nonfinite_skips`) before the run stops; 0 = the first one stops every rank with an error naming the "
        "iteration, the metric and the newest checkpoint.",
    )

    @property
    def critic_free(self) -> bool:
        """``grpo``/``rloo``: no value head exists (no module, parameters, optimizer state, value loss)."""
        return self.estimator != "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether any KL to a reference can be non-zero; if not, no reference is built at all."""
        return self.init_kl_coef > 0 or self.target_kl is not None


@dataclass
class RewardFnSpec:
    fn: str = _f("", "Import path of a reward function: `pkg.mod:attr` or `path/to/file.py:attr`.")
    weight: float = _f(1.0, "Weight of this function in the summed score.")
    name: str = _f("", "Metric name (`reward/<name>`); default: the attribute name.")
    kwargs: dict[str, Any] = _f({}, "If set, `fn` is a factory: `fn(**kwargs)` builds the reward function.")


@dataclass
class OverlongBufferConfig:
    length: int = _f(0, "Required: the soft zone, in tokens, at the end of `generation.max_new_tokens` (1 .. max_new_tokens).")
    penalty: float = _f(1.0, "The penalty at `generation.max_new_tokens` tokens (> 0; DAPO's 1.0).")


@dataclass
class RewardConfig:
    fn: str | None = _f(
        None, "Import path of the reward function (`pkg.mod:attr` or `file.py:attr`); or pass `reward_fn=`."
    )
    kwargs: dict[str, Any] = _f({}, "If set, `reward.fn` is a factory called as `fn(**kwargs)`.")
    fns: list[RewardFnSpec] = _f([], "Several weighted reward functions (instead of `reward.fn`).")
    placement: Literal["main", "local", "collective"] = _f(
        "main",
        "Where the reward runs: `main` = gather to rank 0, one batched call, scatter back; `local` = each "
        "rank scores its own; `collective` = every rank calls it on the full batch (sharded reward models).",
    )
    batch_size: int | None = _f(
        None, "Micro-batch size of reward calls (null = one call with every sample of the chunk round)."
    )
    url: str | list[str] | None = _f(
        None,
        "URL of a reward server (`rallyrl serve-reward`, or OpenRLHF's), or a list of URLs (each batch split "
        "over them): the reward function is then `rallyrl.RemoteReward` (instead of `reward.fn`/`reward.fns`).",
    )
    timeout_s: float | None = _f(
        None,
        "Seconds a reward call may take. With `reward.url`: per HTTP attempt, then retried (null = 60). "
        "In-process: a longer call stops the run on every rank with a RewardError naming this key (null = no bound).",
    )
    retries: int = _f(3, "With `reward.url`: extra attempts (exponential backoff with jitter) before the run "
                         "stops with a RewardError naming the URL and the last failure.")
    protocol: Literal["rallyrl", "openrlhf"] = _f(
        "rallyrl", "With `reward.url`: `rallyrl` (POST /score) or `openrlhf` (POST /get_reward)."
    )
    overlap: bool = _f(
        False,
        "With `reward.url` (or `reward.server: local`) and `placement: main`: score each chunk round in the "
        "background while the ranks generate and score the next one; rewards are collected once per "
        "iteration, before reward shaping (same results as without).",
    )
    server: Literal["none", "local"] = _f(
        "none",
        "`local`: rank 0 starts `rallyrl serve-reward` for `reward.fn` (+ `reward.kwargs`) as its own child "
        "process on 127.0.0.1 (a free port), waits until it answers, sends every reward call there and stops "
        "it when the run ends, also on failure or Ctrl-C. `none`: rallyrl starts no server.",
    )
    server_args: list[str] = _f(
        [], "With `reward.server: local`: more `rallyrl serve-reward` options, e.g. `[--max-wait-ms, '20']` "
            "(--max-batch, --max-wait-ms, --no-batching, --max-body-mb; the function, host and port are "
            "set by rallyrl).",
    )
    overlong_buffer: OverlongBufferConfig | None = _f(
        None,
        "DAPO's soft overlong punishment: `{length: L, penalty: p}` adds `-p * clamp(n - (max_new_tokens - L), 0, "
        "L) / L` to the score of a response of `n` sampled tokens (0 up to `max_new_tokens - L`, then linear down "
        "to `-p` at `generation.max_new_tokens`), logged as the reward component `reward/overlong`; null = off. "
        "See docs/algorithms.md.",
    )


@dataclass
class EvalConfig:
    interval: int = _f(
        0, "Evaluate every N iterations (0 = only before the first and after the last iteration)."
    )
    do_sample: bool = _f(
        False, "Sample during evaluation with the `generation` settings (False = greedy, deterministic)."
    )
    samples_per_prompt: int = _f(
        1,
        "Completions sampled per eval prompt (k). With k > 1 (which needs `eval.do_sample: true`) every "
        "`metric_fn` metric whose values all lie in [0, 1] is also logged as `eval/<name>@<k>` (mean over "
        "all samples) and `eval/<name>_pass@<k>` (unbiased pass@k, a value of exactly 1 being a pass).",
    )
    metric_fn: str | None = _f(
        None,
        "Import path of `metric_fn(samples, prompts, outputs, **kwargs) -> {name: per-sample values}`, "
        "logged as `eval/<name>`; or pass `metric_fn=` to `rallyrl.train`.",
    )


@dataclass
class CheckpointConfig:
    interval: int = _f(0, "Save a checkpoint every N iterations (0 = off).")
    keep_last: int = _f(2, "How many checkpoints to keep.")
    on_signal: bool = _f(
        True,
        "On SIGTERM or SIGUSR1 (a job scheduler's pre-emption or time-limit warning), every rank finishes the "
        "current iteration, a checkpoint is written and the run exits with code 143; `train.resume: auto` then "
        "continues exactly. False: SIGTERM stops at once (no checkpoint) and SIGUSR1 is not caught. "
        "See docs/checkpoints.md.",
    )


@dataclass
class DistConfig:
    timeout_s: float = _f(600.0, "Collective timeout in seconds (a dead peer ends the job after this).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Strict loading


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list[{_type_name(arg)}]"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)$")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints are accepted for floats)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append((arg, e))
        for arg, e in errors:  # a choice (or a list of choices) says which one was misspelled
            arm = typing.get_args(arg)[0] if typing.get_origin(arg) is list and isinstance(value, list) else arg
            if typing.get_origin(arm) is Literal and (arm is not arg or isinstance(value, str)):
                raise e from None
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):  # a section: its own key's error
                raise e from None
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{key}: expected one of {list(allowed)}, got {value!r}{extra}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (arg,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {value!r}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            # YAML 1.1 (PyYAML) reads "3e-4" as a string; every user means the number.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")  # a bug in this module


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            hint = difflib.get_close_matches(str(k), names, n=1)
            extra = f" (did you mean {(prefix + '.' if prefix else '') + hint[0]!r}?)" if hint else ""
            raise ConfigError(f"unknown config key {key!r}{extra}")
        kwargs[k] = _coerce(v, hints[k], key)
        f = next(f for f in dataclasses.fields(cls) if f.name == k)
        _check_finite(kwargs[k], key, allow_inf=f.metadata.get("allow_inf", False))
    return cls(**kwargs)


def _check_finite(value: Any, key: str, allow_inf: bool) -> None:
    """NaN passes every `> 0` check and inf every `>= 0` one: refuse both where a number is read, unless
    the field documents infinity (metadata ``allow_inf``). Free-form mappings (``kwargs``) are the
    user's own and not checked."""
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]", allow_inf)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader (plain data only: no tag ever constructs an object), plus: a key given twice in
    one mapping is an error. PyYAML keeps the last value silently, so a config with `iterations: 1` and,
    further down, `iterations: 3` would train 3 iterations without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges are allowed to override
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key (a list): the base class reports it
                continue
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"key {key!r} is given twice (lines {first} and {second}); keep one")
        self.key, self.first, self.second = key, first, second


def _yaml_error_line(e: yaml.YAMLError) -> str:
    """A YAML error as one line: a duplicate key names both lines; a tag names the tag (safe loading never
    constructs objects from tags such as `!!python/object`); a syntax error keeps its line and column."""
    if isinstance(e, _DuplicateKey):
        return str(e)
    if isinstance(e, yaml.constructor.ConstructorError) and e.problem and "constructor for the tag" in e.problem:
        tag = e.problem.split("tag", 1)[1].strip(" '")
        where = f"line {e.problem_mark.line + 1}: " if e.problem_mark else ""
        return (f"{where}the YAML tag {tag.replace('tag:yaml.org,2002:', '!!')!r} is not allowed (configs are "
                f"plain data: mappings, lists, strings, numbers, booleans, null)")
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = "; ".join(x for x in (e.context, e.problem) if x)
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what
    return " ".join(str(e).split())


def load_yaml(text: str) -> Any:
    """Strict YAML (see ``_StrictLoader``); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["ppo.lr=3e-4", "data.prompts=[a, b]"]`` -> dotted keys with YAML-parsed values."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            parsed = load_yaml(v) if v != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {k}: value {v!r} is not valid YAML: {_yaml_error_line(e)}") from None
        out.append((k.strip(), parsed))
    return out


def load_config(source: Config | dict | str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated ``Config`` from a Config, a dict, or a YAML path, plus ``key=value`` overrides."""
    if isinstance(source, Config):
        data = source.to_dict()
    elif isinstance(source, dict):
        data = dict(source)
    elif source is None:
        data = {}
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = load_yaml(read_text(path, "config file"))
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_error_line(e)}") from None
        data = {} if data is None else data  # an empty file: every default
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections (model:, train:, ...) at the "
                              f"top level, not a {type(data).__name__}")
    data = _to_plain(data)
    for k, v in parse_overrides(overrides or []):
        _set_dotted(data, k, v)
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def read_text(path: str | Path, what: str, error: type[Exception] = ConfigError) -> str:
    """A user's text file, read as UTF-8 (a byte-order mark is accepted and dropped). Bad bytes are an
    ``error`` (default ``ConfigError``) naming the file, the byte offset and the fix."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(
            f"{what} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"save it as UTF-8"
        ) from None


def _to_plain(data: Any) -> Any:
    """Deep-copy nested dicts/lists (so overrides never mutate the caller's dict)."""
    if isinstance(data, dict):
        return {k: _to_plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_to_plain(v) for v in data]
    return data


def validate(cfg: Config) -> None:
    """Value checks that types cannot express. Raises ConfigError naming the key."""
    def positive(key: str, v: int | float | None, allow_zero: bool = False) -> None:
        if v is None:
            return
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {v}")

    positive("rollout.num_rollouts", cfg.rollout.num_rollouts)
    positive("rollout.chunk_size", cfg.rollout.chunk_size)
    positive("generation.max_new_tokens", cfg.generation.max_new_tokens)
    positive("generation.temperature", cfg.generation.temperature)
    positive("generation.top_k", cfg.generation.top_k, allow_zero=True)
    if not 0 < cfg.generation.top_p <= 1:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {cfg.generation.top_p}")
    if any(s == "" for s in cfg.generation.stop_sequences):
        raise ConfigError("generation.stop_sequences must not contain an empty string")
    positive("train.iterations", cfg.train.iterations, allow_zero=True)
    positive("eval.interval", cfg.eval.interval, allow_zero=True)
    positive("eval.samples_per_prompt", cfg.eval.samples_per_prompt)
    if cfg.eval.samples_per_prompt > 1 and not cfg.eval.do_sample:
        raise ConfigError(f"eval.samples_per_prompt={cfg.eval.samples_per_prompt} needs eval.do_sample: true "
                          f"(greedy decoding would give the same completion {cfg.eval.samples_per_prompt} times)")
    positive("train.num_threads", cfg.train.num_threads, allow_zero=True)
    positive("ppo.epochs", cfg.ppo.epochs)
    positive("ppo.num_minibatches", cfg.ppo.num_minibatches)
    positive("ppo.micro_batch_size", cfg.ppo.micro_batch_size)
    positive("ppo.lr", cfg.ppo.lr)
    positive("ppo.warmup_steps", cfg.ppo.warmup_steps, allow_zero=True)
    positive("ppo.max_grad_norm", cfg.ppo.max_grad_norm)
    positive("ppo.clip_range", cfg.ppo.clip_range)
    positive("ppo.clip_range_value", cfg.ppo.clip_range_value)
    positive("ppo.init_kl_coef", cfg.ppo.init_kl_coef, allow_zero=True)
    positive("ppo.target_kl", cfg.ppo.target_kl)
    positive("ppo.kl_horizon", cfg.ppo.kl_horizon)
    positive("ppo.reward_clip", cfg.ppo.reward_clip)
    positive("ppo.max_nonfinite_skips", cfg.ppo.max_nonfinite_skips, allow_zero=True)
    _check_estimator(cfg)
    if cfg.train.mixed_precision == "fp16":
        raise ConfigError("train.mixed_precision=fp16 is not supported: float16 training needs a dynamic loss "
                          "scaler, which rallyrl does not implement (it could not be tested here: CPU autocast "
                          "has no float16 and no GPU was lent). Use bf16, which needs no scaler")
    for key in ("gamma", "lam"):
        v = getattr(cfg.ppo, key)
        if not 0 <= v <= 1:
            raise ConfigError(f"ppo.{key} must be in [0, 1], got {v}")
    positive("reward.batch_size", cfg.reward.batch_size)
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    positive("dist.timeout_s", cfg.dist.timeout_s)
    positive("model.num_layers_unfrozen", cfg.model.num_layers_unfrozen)
    if cfg.model.arch == "seq2seq" and cfg.model.reference != "copy":
        # checked here, not after loading a model: `rallyrl check` and the launcher's preflight see it
        raise ConfigError(f"model.reference={cfg.model.reference!r} is implemented for model.arch=causal only; "
                          f"use model.reference=copy with model.arch=seq2seq")
    positive("model.lora.r", cfg.model.lora.r)
    positive("model.lora.alpha", cfg.model.lora.alpha)
    if cfg.model.lora.dropout != 0:
        raise ConfigError(f"model.lora.dropout must be 0, got {cfg.model.lora.dropout}: the policy runs with dropout "
                          f"off so the rollout's log-probs and the first PPO step's agree (ratio 1)")
    tm = cfg.model.lora.target_modules
    if (isinstance(tm, str) and tm != "all-linear") or (isinstance(tm, list) and (not tm or "" in tm)):
        raise ConfigError(f"model.lora.target_modules must be 'all-linear' or a non-empty list of module names, "
                          f"got {tm!r}")
    if cfg.reward.fn and cfg.reward.fns:
        raise ConfigError("set either reward.fn or reward.fns, not both")
    r = cfg.reward
    if r.url is not None:
        if r.fn or r.fns:
            raise ConfigError(f"set either reward.url or reward.{'fn' if r.fn else 'fns'}, not both "
                              f"(reward.url makes the reward function a RemoteReward)")
        if r.kwargs:
            raise ConfigError("reward.kwargs is for reward.fn; with reward.url use reward.timeout_s, "
                              "reward.retries and reward.protocol")
        if r.placement == "collective":
            raise ConfigError("reward.url works with reward.placement main or local, not collective "
                              "(every rank would send the whole batch to the server)")
        urls = [r.url] if isinstance(r.url, str) else r.url
        if not urls:
            raise ConfigError("reward.url: the list of URLs is empty")
        for i, u in enumerate(urls):
            where = "reward.url" if isinstance(r.url, str) else f"reward.url[{i}]"
            if not (u.startswith("http://") or u.startswith("https://")) or len(u.split("//", 1)[1]) == 0:
                raise ConfigError(f"{where}: {u!r} must look like http://host:port")
    positive("reward.timeout_s", r.timeout_s)
    positive("reward.retries", r.retries, allow_zero=True)
    _check_reward_server(r)
    if r.overlap and ((r.url is None and r.server != "local") or r.placement != "main"):
        raise ConfigError("reward.overlap needs reward.url (or reward.server: local) and reward.placement main: "
                          "only a remote reward can run beside generation without touching the training RNG streams")
    for i, spec in enumerate(cfg.reward.fns):
        if not spec.fn:
            raise ConfigError(f"reward.fns[{i}].fn is required")
    names = [reward_fn_name(s) for s in cfg.reward.fns]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"reward.fns: duplicate names {sorted(dup)}; set reward.fns[i].name")


def _check_estimator(cfg: Config) -> None:
    """The critic-free family and groups (docs/algorithms.md)."""
    ppo, G, n = cfg.ppo, cfg.rollout.samples_per_prompt, cfg.rollout.num_rollouts
    if G < 1:
        raise ConfigError(f"rollout.samples_per_prompt must be >= 1, got {G}")
    if n % G:
        raise ConfigError(f"rollout.num_rollouts={n} must be a multiple of rollout.samples_per_prompt={G} "
                          f"(each iteration samples {G} completions of num_rollouts / {G} prompts)")
    if ppo.critic_free and G < 2:
        raise ConfigError(f"ppo.estimator={ppo.estimator} needs rollout.samples_per_prompt >= 2 (its baseline is "
                          f"the other completions of the same prompt), got {G}")
    if ppo.drop_zero_std_groups and not ppo.critic_free:
        raise ConfigError("ppo.drop_zero_std_groups is for ppo.estimator grpo or rloo (groups of completions)")
    if ppo.group_std_floor <= 0:
        raise ConfigError(f"ppo.group_std_floor must be > 0, got {ppo.group_std_floor}")
    if ppo.clip_range_high is not None and ppo.clip_range_high <= 0:
        raise ConfigError(f"ppo.clip_range_high must be > 0, got {ppo.clip_range_high}")
    _check_objective(cfg)


def _check_objective(cfg: Config) -> None:
    """The policy loss variants and DAPO's sampling and shaping (docs/algorithms.md)."""
    ppo, ro = cfg.ppo, cfg.rollout
    for key in ("sequence_clip_range", "sequence_clip_range_high", "cispo_clip_high", "cispo_clip_low"):
        v = getattr(ppo, key)
        if v is not None and v <= 0:
            raise ConfigError(f"ppo.{key} must be > 0, got {v}")
    if ppo.dual_clip is not None and ppo.dual_clip <= 1:
        raise ConfigError(f"ppo.dual_clip must be > 1 (the cap -c * A must lie beyond the clipped loss), got "
                          f"{ppo.dual_clip}")
    if ppo.policy_loss == "cispo":
        for key, unset in (("ratio_level", ppo.ratio_level == "token"), ("dual_clip", ppo.dual_clip is None),
                           ("clip_range_high", ppo.clip_range_high is None)):
            if not unset:
                raise ConfigError(f"ppo.{key}={getattr(ppo, key)!r} does not apply to ppo.policy_loss=cispo (CISPO "
                                  f"clips a per-token importance weight with ppo.cispo_clip_low/high, not the loss)")
    if ppo.ratio_level == "sequence" and ppo.clip_range_high is not None:
        raise ConfigError("ppo.clip_range_high is the token ratio's; with ppo.ratio_level=sequence set "
                          "ppo.sequence_clip_range_high")
    if ro.dynamic_sampling and (not ppo.critic_free or ro.samples_per_prompt < 2):
        raise ConfigError(f"rollout.dynamic_sampling keeps groups whose rewards differ: it needs ppo.estimator grpo "
                          f"or rloo and rollout.samples_per_prompt >= 2 (got ppo.estimator={ppo.estimator}, "
                          f"rollout.samples_per_prompt={ro.samples_per_prompt})")
    if ro.max_sampling_rounds < 1:
        raise ConfigError(f"rollout.max_sampling_rounds must be >= 1, got {ro.max_sampling_rounds}")
    ob, n = cfg.reward.overlong_buffer, cfg.generation.max_new_tokens
    if ob is not None:
        if not 1 <= ob.length <= n:
            raise ConfigError(f"reward.overlong_buffer.length must be in [1, generation.max_new_tokens={n}] "
                              f"(required when reward.overlong_buffer is set), got {ob.length}")
        if ob.penalty <= 0:
            raise ConfigError(f"reward.overlong_buffer.penalty must be > 0, got {ob.penalty}")
        names = [reward_fn_name(f) for f in cfg.reward.fns] + ([cfg.reward.fn.rsplit(":", 1)[-1]] if cfg.reward.fn else [])
        if "overlong" in names:
            raise ConfigError("reward.overlong_buffer logs its penalty as the reward component 'overlong': rename the "
                              "reward function of that name (reward.fns[i].name)")


def config_warnings(cfg: Config) -> list[str]:
    """Legal settings that are probably mistakes (printed once at the start of a run)."""
    out = []
    if cfg.ppo.kl_in == "loss" and cfg.ppo.kl_estimator == "k1" and cfg.ppo.uses_reference:
        out.append("ppo.kl_in=loss with ppo.kl_estimator=k1: the gradient of k1 in the loss is zero in "
                   "expectation (it does not pull the policy towards the reference); use k3 (GRPO) or k2")
    if cfg.ppo.ratio_level == "sequence" and cfg.ppo.loss_aggregation != "seq_mean_token_mean":
        out.append(f"ppo.ratio_level=sequence with ppo.loss_aggregation={cfg.ppo.loss_aggregation}: each sequence's "
                   f"loss then counts in proportion to its length; the GSPO paper's objective (one term per "
                   f"sequence) is ppo.loss_aggregation=seq_mean_token_mean (TRL warns the same)")
    if cfg.ppo.critic_free and cfg.model.value_head != "linear":
        out.append(f"model.value_head={cfg.model.value_head} is ignored: ppo.estimator={cfg.ppo.estimator} "
                   f"trains no value head")
    return out


# `rallyrl serve-reward` options that `reward.server_args` may pass (option -> takes a value); the
# function (`--fn`/`--kwargs` from reward.fn/reward.kwargs), `--host` and `--port` are rallyrl's.
SERVER_ARGS = {"--max-batch": True, "--max-wait-ms": True, "--no-batching": False, "--max-body-mb": True}


def _check_reward_server(r: RewardConfig) -> None:
    if r.server != "local":
        if r.server_args:
            raise ConfigError("reward.server_args is for reward.server: local (the server rallyrl starts)")
        return
    if r.url is not None:
        raise ConfigError("reward.server: local starts the server and picks its URL: remove reward.url (or set "
                          "reward.server: none to use a server you started)")
    if r.fns:
        raise ConfigError("reward.server: local serves one function: set reward.fn (+ reward.kwargs), not reward.fns")
    if not r.fn:
        raise ConfigError("reward.server: local needs reward.fn: the import path of the function the server serves")
    if r.placement != "main":
        raise ConfigError(f"reward.server: local needs reward.placement main, not {r.placement!r}: the server "
                          f"listens on 127.0.0.1 of rank 0's machine, which only rank 0 is sure to reach")
    i = 0
    while i < len(r.server_args):
        opt = r.server_args[i]
        name = opt.split("=", 1)[0]
        if name in ("--fn", "--kwargs", "--model", "--label", "--device", "--host", "--port"):
            raise ConfigError(f"reward.server_args: {name} is set by rallyrl (the function comes from reward.fn "
                              f"and reward.kwargs; the server binds 127.0.0.1 on a free port)")
        if name not in SERVER_ARGS:
            raise ConfigError(f"reward.server_args: unknown option {opt!r}; allowed: {', '.join(SERVER_ARGS)}")
        if SERVER_ARGS[name] and "=" not in opt:
            if i + 1 >= len(r.server_args):
                raise ConfigError(f"reward.server_args: {name} needs a value")
            i += 1
        i += 1


def reward_fn_name(spec: RewardFnSpec) -> str:
    if spec.name:
        return spec.name
    return spec.fn.rsplit(":", 1)[-1] if ":" in spec.fn else spec.fn


# --------------------------------------------------------------------------------------------------
# Derived batch plan


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic, derived once from the config and the world size.

    ``num_rollouts`` global samples are split over ``world_size`` ranks as evenly as possible (the first
    ``num_rollouts % world_size`` ranks get one more). Every rank runs the same number of chunk rounds
    (``rounds``) so the central reward step is entered the same number of times everywhere; in a round a
    rank may have fewer samples than ``chunk_size``, even none.
    """

    world_size: int
    num_rollouts: int
    chunk_size: int
    local_counts: tuple[int, ...]
    rounds: int
    num_minibatches: int
    epochs: int
    samples_per_prompt: int = 1  # G: consecutive global samples [g*G, (g+1)*G) are group g's members

    @property
    def prompts_per_iteration(self) -> int:
        return self.num_rollouts // self.samples_per_prompt

    def sample_prompts(self, prompt_indices: list[int]) -> list[int]:
        """The global batch's prompt index per sample: each drawn prompt repeated G times in a row, so
        sample ``i`` belongs to group ``i // G`` (the group id), as member ``i % G``."""
        return [p for p in prompt_indices for _ in range(self.samples_per_prompt)]

    @property
    def optimizer_steps_per_iteration(self) -> int:
        return self.epochs * self.num_minibatches

    def local_count(self, rank: int) -> int:
        return self.local_counts[rank]

    def offset(self, rank: int) -> int:
        """Index of this rank's first sample in the global (rank-major) order."""
        return sum(self.local_counts[:rank])

    def round_counts(self, rank: int, round_idx: int) -> int:
        """Samples this rank generates in chunk round ``round_idx``."""
        n = self.local_counts[rank]
        return max(0, min(self.chunk_size, n - round_idx * self.chunk_size))


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def make_batch_plan(cfg: Config, world_size: int) -> BatchPlan:
    g = cfg.rollout.num_rollouts
    if g < world_size:
        raise ConfigError(
            f"rollout.num_rollouts={g} is smaller than the number of processes ({world_size}); "
            f"every rank needs at least one sample"
        )
    counts = split_evenly(g, world_size)
    smallest = min(counts)
    if cfg.ppo.num_minibatches > smallest:
        raise ConfigError(
            f"ppo.num_minibatches={cfg.ppo.num_minibatches} exceeds the smallest per-rank batch "
            f"({smallest} = rollout.num_rollouts {g} split over {world_size} processes); every rank must "
            f"take the same number of optimizer steps"
        )
    if cfg.model.sharding == "fsdp" and world_size > 1:
        _check_equal_micro_batches(cfg, counts)
    rounds = -(-max(counts) // cfg.rollout.chunk_size)
    return BatchPlan(
        world_size=world_size,
        num_rollouts=g,
        chunk_size=cfg.rollout.chunk_size,
        local_counts=tuple(counts),
        rounds=rounds,
        num_minibatches=cfg.ppo.num_minibatches,
        epochs=cfg.ppo.epochs,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
    )


def _check_equal_micro_batches(cfg: Config, counts: list[int]) -> None:
    """Under FSDP every forward and backward of the update is a collective (weights are gathered block
    by block), so every rank must run the same number of micro-batches in each optimizer step. A rank's
    minibatches are its samples split as evenly as possible (``torch.tensor_split``), each cut into
    micro-batches of ``ppo.micro_batch_size``."""
    M, mbs = cfg.ppo.num_minibatches, cfg.ppo.micro_batch_size
    per_rank = {tuple(-(-s // (mbs or s)) for s in split_evenly(n, M)) for n in counts}
    if len(per_rank) > 1:
        raise ConfigError(
            f"model.sharding=fsdp: with rollout.num_rollouts={cfg.rollout.num_rollouts} over {len(counts)} "
            f"processes ({'/'.join(map(str, counts))} samples per rank), ppo.num_minibatches={M} and "
            f"ppo.micro_batch_size={mbs}, ranks would run different numbers of micro-batches per optimizer "
            f"step ({' vs '.join(str(list(p)) for p in sorted(per_rank))}); under FSDP every forward is a "
            f"collective. Make rollout.num_rollouts a multiple of the process count, or raise or unset "
            f"ppo.micro_batch_size")


# --------------------------------------------------------------------------------------------------
# What changed between two configs (resume compares the run's recorded config with the new one)

# Keys whose change never alters what is trained: how long the run goes, what is logged, how often it is
# saved, resources and control flags. Everything else (optimizer, PPO, rollout, generation, seed, model,
# reward, data, eval) needs `train.allow_config_change`; so does any key not listed here, new ones included.
FREE_TO_CHANGE = frozenset({
    "train.iterations", "train.run_dir", "train.log_rollouts", "train.tensorboard", "train.progress",
    "train.save_final", "train.num_threads", "train.overwrite", "train.resume", "train.allow_config_change",
    "train.report_to", "train.project", "train.run_name",
    "checkpoint.interval", "checkpoint.keep_last", "checkpoint.on_signal", "train.lock_run_dir", "dist.timeout_s",
    "reward.overlap",  # the same rewards, only scored beside generation: same results (tested)
})

_ABSENT = "<absent>"


@dataclass(frozen=True)
class Change:
    key: str  # dotted key, e.g. "ppo.lr"
    old: Any  # the recorded value (``"<absent>"`` if the old config lacks the key)
    new: Any
    needs_permission: bool  # True: it alters training (see FREE_TO_CHANGE)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> ``{dotted key: leaf}``; lists (prompts, reward.fns, stop sequences) are leaves."""
    if not isinstance(d, dict) or (prefix and not d):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        # free-form mappings (reward kwargs) compare as one value: their keys are the user's, not ours
        out.update({key: v} if k == "kwargs" else _flatten(v, key))
    return out


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as ``{"section.key": value}`` (what trackers log as the run's parameters)."""
    return _flatten(cfg.to_dict())


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every dotted key whose value differs between two config dicts (``Config.to_dict()`` or a loaded
    ``config.yaml``), in the order of ``new`` then keys only ``old`` has. Ints and equal floats compare
    equal (``1`` == ``1.0``), so a YAML round trip is no change."""
    a, b = _flatten(old), _flatten(new)
    out = []
    for key in [*b, *(k for k in a if k not in b)]:
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if va != vb:
            out.append(Change(key, va, vb, key not in FREE_TO_CHANGE))
    return out


def _short(v: Any, width: int = 60) -> str:
    s = "null" if v is None else (v if v == _ABSENT else yaml.safe_dump(v, default_flow_style=True, width=10**6)
                                  .strip().removesuffix("...").strip())
    return s if len(s) <= width else s[: width - 3] + "..."


def format_changes(changes: list[Change], indent: str = "  ") -> str:
    """One ``key: old -> new`` line per change (long values shortened)."""
    return "\n".join(f"{indent}{c.key}: {_short(c.old)} -> {_short(c.new)}" for c in changes)


# --------------------------------------------------------------------------------------------------
# Reference documentation (docs/config.md is generated from the field docs)


def _default_repr(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(v):
            return "see below"
        return yaml.safe_dump(v, default_flow_style=True).strip()
    return ""


def _sub_table(title: str, cls: type, prefix: str) -> list[str]:
    """The markdown table of a nested config dataclass (``model.lora``, each ``reward.fns`` entry)."""
    lines = [title, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _type_name(hints[f.name]).replace("|", "\\|")
        lines.append(f"| `{prefix}{f.name}` | {tp} | `{_default_repr(f)}` | {f.metadata.get('doc', '')} |")
    return lines + [""]


def config_markdown() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `rallyrl/config.py` (`python -m rallyrl.config --markdown > docs/config.md`); a test",
        "fails when this page and the code disagree. Every key can be set in the YAML file or on the",
        "command line with `--set section.key=value` (the value is parsed as YAML). Unknown keys and wrong",
        "types are errors naming the key, raised before any model is loaded.",
        "",
        "## Editor support: the JSON Schema",
        "",
        "`rallyrl schema` prints a JSON Schema (draft 2020-12) of this whole page: every key with its type,",
        "choices, default, range and meaning. Save it once per rallyrl version and name it on a config's first",
        "line; editors that use the YAML language server (VS Code's YAML extension, Neovim, JetBrains, Helix, Zed)",
        "then complete keys, show each key's meaning on hover and mark a wrong type, a misspelled choice or a",
        "value out of range as you type:",
        "",
        "```bash",
        "rallyrl schema > rallyrl-config.schema.json",
        "```",
        "",
        "```yaml",
        "# yaml-language-server: $schema=rallyrl-config.schema.json",
        "model:",
        "  path: models/tiny",
        "```",
        "",
        "The path is relative to the YAML file (a URL works too). In VS Code you can instead map it to a",
        "glob in `settings.json`: `\"yaml.schemas\": {\"./rallyrl-config.schema.json\": \"configs/*.yaml\"}`. The",
        "schema holds what a single key can be; checks across keys (e.g. `reward.url` with `reward.fn`) and",
        "the batch plan are made by `rallyrl check CONFIG --nproc N`. The loader stays the authority: the",
        "schema is generated from the same dataclasses (a test keeps the two in agreement).",
        "",
    ]
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        lines += [f"## `{section.name}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = _type_name(hints[f.name]).replace("|", "\\|")
            lines.append(
                f"| `{section.name}.{f.name}` | {tp} | `{_default_repr(f)}` | {f.metadata.get('doc', '')} |"
            )
        lines.append("")
        if cls is ModelConfig:
            lines += _sub_table("`model.lora`:", LoraConfig, "model.lora.")
        if cls is RewardConfig:
            lines += _sub_table("Each entry of `reward.fns`:", RewardFnSpec, "")
            lines += _sub_table("`reward.overlong_buffer` (when set):", OverlongBufferConfig, "reward.overlong_buffer.")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(config_markdown())
