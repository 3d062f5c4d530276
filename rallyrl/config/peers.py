"""The peers' option names (TRL, OpenRLHF, veRL, trlx) and the rallyrl key each one is.

One table, read twice: the loader's "did you mean" for an unknown key (``suggest.py``) and the section
"Coming from TRL / OpenRLHF / veRL" of docs/config.md (``docs.py``). Names that rallyrl shares with a peer
(``gamma``, ``lam``, ``vf_coef``, ``temperature``, ``top_p``, ``seed``, ``weight_decay``, ``warmup_steps``,
``max_grad_norm``, ``init_kl_coef``, ``kl_estimator``, ``target_modules``, ``report_to``, ...) are not
listed: the loader finds a known name given in the wrong section by itself.

Sources: TRL's ``GRPOConfig`` / ``RLOOConfig`` / ``PPOConfig`` and ``TrainingArguments``, OpenRLHF's
``train_ppo_ray`` options, veRL's ``ppo_trainer.yaml`` (docs/algorithms.md, shared/critic-free-peers.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerOption:
    name: str  # the peer's option: a leaf (`num_generations`) or a dotted tail (`rollout.n`)
    who: str  # whose name it is
    key: str  # the rallyrl key
    note: str = ""  # what differs: values, units, what else to set


_SAMPLES = "rallyrl counts samples (prompts x `rollout.samples_per_prompt`), not prompts"

# fmt: off
PEER_OPTIONS: tuple[PeerOption, ...] = (
    # TRL (GRPOConfig, RLOOConfig, PPOConfig, TrainingArguments)
    PeerOption("learning_rate", "TRL", "ppo.lr"),
    PeerOption("num_generations", "TRL", "rollout.samples_per_prompt"),
    PeerOption("max_completion_length", "TRL", "generation.max_new_tokens"),
    PeerOption("beta", "TRL", "ppo.init_kl_coef",
               "TRL's GRPOTrainer adds beta * k3 KL to the loss, so also set `ppo.kl_in: loss` and "
               "`ppo.kl_estimator: k3` (RLOOTrainer puts k1 in the reward, rallyrl's default); TRL's GRPO "
               "default is 0 (no reference model), rallyrl's 0.05"),
    PeerOption("kl_coef", "TRL / veRL", "ppo.init_kl_coef", "KL in the reward, as rallyrl's default `ppo.kl_in: reward`"),
    PeerOption("epsilon", "TRL", "ppo.clip_range"),
    PeerOption("epsilon_high", "TRL", "ppo.clip_range_high"),
    PeerOption("cliprange", "TRL / trlx", "ppo.clip_range"),
    PeerOption("cliprange_value", "TRL / trlx / veRL", "ppo.clip_range_value"),
    PeerOption("loss_type", "TRL", "ppo.loss_aggregation",
               "`grpo` is `seq_mean_token_mean`; `bnpo` and `dapo` are `token_mean`; `dr_grpo` is `seq_mean_token_sum`"),
    PeerOption("scale_rewards", "TRL", "ppo.group_scale",
               "`true` / `group` is `group`, `batch` is `batch`, `false` / `none` is `none`"),
    PeerOption("num_iterations", "TRL", "ppo.epochs",
               "TRL's mu (updates per generation batch); rallyrl's `ppo.epochs` passes over an iteration's "
               "samples take `ppo.num_minibatches` optimizer steps each"),
    PeerOption("num_ppo_epochs", "TRL", "ppo.epochs"),
    PeerOption("num_mini_batches", "TRL", "ppo.num_minibatches"),
    PeerOption("response_length", "TRL / veRL", "generation.max_new_tokens"),
    PeerOption("adam_epsilon", "TRL", "ppo.adam_eps"),
    PeerOption("lr_scheduler_type", "TRL", "ppo.lr_schedule", "rallyrl has `constant`, `linear` and `cosine`"),
    PeerOption("reward_weights", "TRL", "reward.fns", "each entry of `reward.fns` has its own `weight`"),
    PeerOption("generation_batch_size", "TRL", "rollout.num_rollouts"),
    PeerOption("per_device_train_batch_size", "TRL", "rollout.num_rollouts",
               "rallyrl sets the GLOBAL samples per iteration (split over the processes) and the "
               "forward/backward size `ppo.micro_batch_size`"),
    PeerOption("gradient_accumulation_steps", "TRL", "ppo.micro_batch_size",
               "rallyrl sets the samples per forward/backward, not a count of them"),
    PeerOption("output_dir", "TRL", "train.run_dir"),
    PeerOption("max_steps", "TRL", "train.iterations",
               "rallyrl counts iterations (one round of `rollout.num_rollouts` samples and its updates), "
               "not optimizer steps"),
    PeerOption("num_train_epochs", "TRL", "train.iterations", "rallyrl counts iterations, not passes over the data"),
    PeerOption("save_steps", "TRL / OpenRLHF", "checkpoint.interval", "counted in iterations"),
    PeerOption("save_total_limit", "TRL", "checkpoint.keep_last"),
    PeerOption("resume_from_checkpoint", "TRL", "train.resume", "`latest`, `auto` or a checkpoint folder"),
    PeerOption("eval_steps", "TRL / OpenRLHF", "eval.interval", "counted in iterations"),
    PeerOption("bf16", "TRL / OpenRLHF", "train.mixed_precision", "`bf16: true` is `train.mixed_precision: bf16`"),
    PeerOption("importance_sampling_level", "TRL", "ppo.ratio_level",
               "`sequence` (GSPO) is `sequence`, with its own clip range `ppo.sequence_clip_range(_high)`"),
    PeerOption("mask_truncated_completions", "TRL", "ppo.mask_truncated"),
    # OpenRLHF
    PeerOption("n_samples_per_prompt", "OpenRLHF", "rollout.samples_per_prompt"),
    PeerOption("actor_learning_rate", "OpenRLHF", "ppo.lr"),
    PeerOption("eps_clip", "OpenRLHF", "ppo.clip_range"),
    PeerOption("eps_clip_low_high", "OpenRLHF", "ppo.clip_range_high",
               "OpenRLHF takes `low high`: the low one is `ppo.clip_range`, the high one `ppo.clip_range_high`"),
    PeerOption("value_clip", "OpenRLHF", "ppo.clip_range_value"),
    PeerOption("lambd", "OpenRLHF", "ppo.lam"),
    PeerOption("kl_target", "OpenRLHF", "ppo.target_kl"),
    PeerOption("generate_max_len", "OpenRLHF", "generation.max_new_tokens"),
    PeerOption("max_epochs", "OpenRLHF", "ppo.epochs"),
    PeerOption("max_norm", "OpenRLHF", "ppo.max_grad_norm"),
    PeerOption("l2", "OpenRLHF", "ppo.weight_decay"),
    PeerOption("micro_train_batch_size", "OpenRLHF", "ppo.micro_batch_size"),
    PeerOption("rollout_batch_size", "OpenRLHF", "rollout.num_rollouts", f"OpenRLHF counts prompts; {_SAMPLES}"),
    PeerOption("train_batch_size", "OpenRLHF", "ppo.num_minibatches",
               "OpenRLHF gives the samples per optimizer step; rallyrl the optimizer steps per epoch "
               "(`rollout.num_rollouts / train_batch_size`)"),
    PeerOption("advantage_estimator", "OpenRLHF", "ppo.estimator",
               "`group_norm` is `grpo`; `dr_grpo` is `grpo` with `ppo.group_scale: none`; `rloo` and `gae` "
               "are themselves"),
    PeerOption("use_kl_loss", "OpenRLHF / veRL", "ppo.kl_in", "`use_kl_loss: true` is `ppo.kl_in: loss`"),
    PeerOption("entropy_loss_coef", "OpenRLHF", "ppo.entropy_coef"),
    PeerOption("dynamic_filtering", "OpenRLHF", "rollout.dynamic_sampling",
               "re-samples until the batch is full; `ppo.drop_zero_std_groups` only leaves all-equal groups out"),
    PeerOption("dynamic_filtering_enable", "OpenRLHF", "rollout.dynamic_sampling"),
    PeerOption("policy_loss_type", "OpenRLHF", "ppo.ratio_level", "`gspo` is `ppo.ratio_level: sequence`"),
    PeerOption("overlong_buffer_len", "OpenRLHF", "reward.overlong_buffer",
               "`reward.overlong_buffer: {length: L, penalty: p}`"),
    PeerOption("overlong_penalty_factor", "OpenRLHF", "reward.overlong_buffer",
               "`reward.overlong_buffer: {length: L, penalty: p}`"),
    PeerOption("remote_rm_url", "OpenRLHF", "reward.url", "with `reward.protocol: openrlhf` for OpenRLHF's server"),
    PeerOption("input_key", "OpenRLHF", "data.prompt_column"),
    PeerOption("prompt_data", "OpenRLHF", "data.prompts"),
    PeerOption("pretrain", "OpenRLHF", "model.path"),
    PeerOption("lora_rank", "OpenRLHF / veRL", "model.lora.r", "with `model.reference: lora`"),
    PeerOption("lora_alpha", "OpenRLHF / veRL / peft", "model.lora.alpha"),
    PeerOption("lora_dropout", "OpenRLHF / peft", "model.lora.dropout", "only 0 is accepted (docs/config.md)"),
    PeerOption("max_ckpt_num", "OpenRLHF", "checkpoint.keep_last"),
    PeerOption("reward_clip_range", "OpenRLHF", "ppo.reward_clip", "OpenRLHF takes `low high`; rallyrl clips to [-x, x]"),
    PeerOption("normalize_reward", "OpenRLHF", "ppo.reward_scaling",
               "`normalize_reward: true` is `ppo.reward_scaling: running`"),
    PeerOption("use_tensorboard", "OpenRLHF", "train.report_to", "`train.report_to: [tensorboard]`"),
    PeerOption("use_wandb", "OpenRLHF", "train.report_to", "`train.report_to: [wandb]`"),
    # veRL
    PeerOption("rollout.n", "veRL", "rollout.samples_per_prompt"),
    PeerOption("adv_estimator", "veRL", "ppo.estimator", "`grpo`, `rloo` and `gae` are the same names"),
    PeerOption("norm_adv_by_std_in_grpo", "veRL", "ppo.group_scale", "`false` is `none`"),
    PeerOption("use_kl_in_reward", "veRL", "ppo.kl_in", "`use_kl_in_reward: true` is `ppo.kl_in: reward`"),
    PeerOption("kl_loss_coef", "veRL", "ppo.init_kl_coef", "with `ppo.kl_in: loss`"),
    PeerOption("kl_loss_type", "veRL", "ppo.kl_estimator", "`kl` is `k1`, `mse` is `k2`, `low_var_kl` is `k3`"),
    PeerOption("kl_penalty", "veRL", "ppo.kl_estimator", "`kl` is `k1`, `mse` is `k2`, `low_var_kl` is `k3`"),
    PeerOption("horizon", "veRL / trlx", "ppo.kl_horizon"),
    PeerOption("clip_ratio", "veRL", "ppo.clip_range"),
    PeerOption("clip_ratio_low", "veRL", "ppo.clip_range"),
    PeerOption("clip_ratio_high", "veRL", "ppo.clip_range_high"),
    PeerOption("loss_agg_mode", "veRL", "ppo.loss_aggregation",
               "`token-mean` is `token_mean`, `seq-mean-token-mean` is `seq_mean_token_mean`, "
               "`seq-mean-token-sum-norm` is `seq_mean_token_sum`"),
    PeerOption("ppo_epochs", "veRL / trlx", "ppo.epochs"),
    PeerOption("ppo_mini_batch_size", "veRL", "ppo.num_minibatches",
               "veRL gives the prompts per optimizer step; rallyrl the optimizer steps per epoch"),
    PeerOption("ppo_micro_batch_size_per_gpu", "veRL", "ppo.micro_batch_size"),
    PeerOption("entropy_coeff", "veRL", "ppo.entropy_coef"),
    PeerOption("grad_clip", "veRL", "ppo.max_grad_norm"),
    PeerOption("lr_warmup_steps", "veRL", "ppo.warmup_steps"),
    PeerOption("data.train_batch_size", "veRL", "rollout.num_rollouts", f"veRL counts prompts; {_SAMPLES}"),
    PeerOption("max_response_length", "veRL", "generation.max_new_tokens"),
    PeerOption("filter_groups", "veRL", "rollout.dynamic_sampling",
               "re-samples until the batch is full (`rollout.max_sampling_rounds`); `ppo.drop_zero_std_groups` "
               "only leaves all-equal groups out"),
    PeerOption("max_num_gen_batches", "veRL", "rollout.max_sampling_rounds"),
    PeerOption("loss_mode", "veRL", "ppo.policy_loss",
               "`cispo` is `ppo.policy_loss: cispo`; `gspo` is `ppo.ratio_level: sequence`; `vanilla` is the default"),
    PeerOption("clip_ratio_c", "veRL", "ppo.dual_clip"),
    PeerOption("total_training_steps", "veRL", "train.iterations"),
    PeerOption("save_freq", "veRL", "checkpoint.interval"),
    PeerOption("test_freq", "veRL", "eval.interval"),
    PeerOption("max_actor_ckpt_to_keep", "veRL", "checkpoint.keep_last"),
    PeerOption("default_local_dir", "veRL", "train.run_dir"),
    PeerOption("enable_gradient_checkpointing", "veRL", "model.gradient_checkpointing"),
    PeerOption("prompt_key", "veRL", "data.prompt_column"),
    PeerOption("train_files", "veRL", "data.prompts"),
    PeerOption("val_files", "veRL", "data.eval_prompts"),
    PeerOption("project_name", "veRL", "train.project"),
    PeerOption("experiment_name", "veRL", "train.run_name"),
    PeerOption("logger", "veRL", "train.report_to"),
    PeerOption("resume_mode", "veRL", "train.resume",
               "`auto` is `auto`; `disable`: leave it unset; `resume_path`: the checkpoint folder itself"),
    # trlx (rallyrl's reward functions keep its signature)
    PeerOption("scale_reward", "trlx", "ppo.reward_scaling", "`running` is `running`"),
    PeerOption("cliprange_reward", "trlx", "ppo.reward_clip"),
    # generation engines and the engine/trainer mismatch correction (docs/engines.md)
    PeerOption("use_vllm", "TRL", "generation.engine", "`generation.engine: vllm`; rallyrl's is always colocated"),
    PeerOption("vllm_mode", "TRL", "generation.engine",
               "rallyrl runs vLLM in-process on every rank (TRL's `colocate`); there is no server mode"),
    PeerOption("vllm_gpu_memory_utilization", "TRL", "generation.vllm.memory_fraction"),
    PeerOption("vllm_importance_sampling_correction", "TRL", "ppo.engine_correction",
               "TRL's is on by default (`sequence_mask`, cap 3); rallyrl's default is `none`"),
    PeerOption("vllm_importance_sampling_mode", "TRL", "ppo.engine_correction",
               "`token_truncate` = `tis`; `token_mask` / `sequence_mask` = `mask` with `ppo.engine_correction_level`"),
    PeerOption("vllm_importance_sampling_clip_max", "TRL", "ppo.engine_correction_cap"),
    PeerOption("rollout.name", "veRL", "generation.engine"),
    PeerOption("rollout_correction", "veRL", "ppo.engine_correction"),
    PeerOption("rollout.gpu_memory_utilization", "veRL", "generation.vllm.memory_fraction"),
    PeerOption("is_correction_enable", "OpenRLHF", "ppo.engine_correction"),
    PeerOption("is_correction_type", "OpenRLHF", "ppo.engine_correction",
               "`tis` = `tis`; `icepop` = `mask`; `seq-mask-tis` has no single equivalent"),
    PeerOption("is_correction_threshold", "OpenRLHF", "ppo.engine_correction_low",
               "[low, high]: `ppo.engine_correction_low` / `ppo.engine_correction_high` (`mask`), or the cap (`tis`)"),
)
# fmt: on


def peer_option(dotted: str) -> PeerOption | None:
    """The table's entry for an unknown dotted key: the longest ``name`` that is the whole key or its
    tail (``train.num_generations`` finds ``num_generations``; ``rollout.n`` finds ``rollout.n``)."""
    hits = [p for p in PEER_OPTIONS if dotted == p.name or dotted.endswith("." + p.name)]
    return max(hits, key=lambda p: len(p.name)) if hits else None
