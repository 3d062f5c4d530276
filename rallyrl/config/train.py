"""`train:`, `eval:`, `checkpoint:` and `dist:`: the run itself (length, logging, saving, processes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import TRACKERS, _f


@dataclass
class TrainConfig:
    seed: int = _f(0, "Seed of everything (model init, prompt order; sampling is seeded per rank from it).")
    run_dir: str = _f("runs/default", "Run directory: config.yaml, metrics.jsonl, rollouts.jsonl, final/.")
    iterations: int = _f(10, "PPO iterations (collect `rollout.num_rollouts` samples, then update).", ge=0)
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
        0, "torch intra-op threads per process (0 = `OMP_NUM_THREADS` when it is set, else cores / local processes).",
        ge=0,
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = _f(
        "no",
        "Compute dtype of the forward and backward passes, generation and the reference pass: `no` (the stored "
        "dtype, `model.dtype`) or `bf16` (bfloat16 compute over float32 weights, gradient reduction and "
        "optimizer state: autocast under ddp, FSDP2's MixedPrecisionPolicy under fsdp; log-probs, KL, "
        "advantages and losses stay float32). `fp16` is refused (it needs a loss scaler). See docs/scaling.md.",
        unsupported={"fp16": "float16 training needs a dynamic loss scaler, which rallyrl does not implement (it "
                             "could not be tested here: CPU autocast has no float16 and no GPU was lent). Use bf16, "
                             "which needs no scaler"},
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
class EvalConfig:
    interval: int = _f(
        0, "Evaluate every N iterations (0 = only before the first and after the last iteration).",
        ge=0,
    )
    do_sample: bool = _f(
        False, "Sample during evaluation with the `generation` settings (False = greedy, deterministic)."
    )
    samples_per_prompt: int = _f(
        1,
        "Completions sampled per eval prompt (k). With k > 1 (which needs `eval.do_sample: true`) every "
        "`metric_fn` metric whose values all lie in [0, 1] is also logged as `eval/<name>@<k>` (mean over "
        "all samples) and `eval/<name>_pass@<k>` (unbiased pass@k, a value of exactly 1 being a pass).",
        gt=0,
    )
    metric_fn: str | None = _f(
        None,
        "Import path of `metric_fn(samples, prompts, outputs, **kwargs) -> {name: per-sample values}`, "
        "logged as `eval/<name>`; or pass `metric_fn=` to `rallyrl.train`.",
    )


@dataclass
class CheckpointConfig:
    interval: int = _f(0, "Save a checkpoint every N iterations (0 = off).", ge=0)
    keep_last: int = _f(2, "How many checkpoints to keep.", gt=0)
    on_signal: bool = _f(
        True,
        "On SIGTERM or SIGUSR1 (a job scheduler's pre-emption or time-limit warning), every rank finishes the "
        "current iteration, a checkpoint is written and the run exits with code 143; `train.resume: auto` then "
        "continues exactly. False: SIGTERM stops at once (no checkpoint) and SIGUSR1 is not caught. "
        "See docs/checkpoints.md.",
    )


@dataclass
class DistConfig:
    timeout_s: float = _f(600.0, "Collective timeout in seconds (a dead peer ends the job after this).", gt=0)


