"""Reward functions used by the tests (importable as `tests.helpers.rewards:NAME`).

These are USER code as far as rallyrl is concerned: they may call torch.distributed directly (as a
sharded reward model would) and draw from the global RNGs (which rallyrl must isolate).
"""

import atexit
import hashlib
import json
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch


def deterministic_score(prompt: str, output: str) -> float:
    """A score that depends on exactly this (prompt, output) pair, so a mixed-up scatter is visible."""
    h = hashlib.sha256(f"{prompt}\x00{output}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _log_call(samples, kwargs, **extra) -> None:
    log = os.environ.get("RALLYRL_TEST_CALL_LOG")
    if log:  # record who called the reward function, with how many samples (and which, if they have ids)
        rec = {"rank": _rank(), "n": len(samples), "pid": os.getpid(),
               "command": sys.argv[1] if len(sys.argv) > 1 else None, **extra}  # e.g. "train", "serve-reward"
        if "id" in kwargs:
            rec["ids"] = kwargs["id"]
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _check_aligned(samples, prompts, outputs, kwargs) -> None:
    """Every per-sample list must be aligned with the samples (metadata `expected_prompt` = the prompt)."""
    n = len(samples)
    assert all(s == p + o for s, p, o in zip(samples, prompts, outputs))
    assert len(prompts) == len(outputs) == len(kwargs["output_token_ids"]) == n
    if "expected_prompt" in kwargs:
        got = kwargs["expected_prompt"]
        assert len(got) == n, f"metadata column has {len(got)} values for {n} samples"
        bad = [i for i in range(n) if got[i] != prompts[i]]
        assert not bad, f"metadata misaligned at {bad}: {[(got[i], prompts[i]) for i in bad]}"


def hashed(samples, prompts, outputs, **kwargs):
    _log_call(samples, kwargs)
    _check_aligned(samples, prompts, outputs, kwargs)
    return [deterministic_score(p, o) for p, o in zip(prompts, outputs)]


def hashed_with_crashes(samples, prompts, outputs, **kwargs):
    """`hashed`, plus fault injection for tests/dist/test_resume.py (driven by environment variables):

    - RALLYRL_TEST_COUNTER=PATH counts the calls of this run in the file PATH (it survives a restart);
    - RALLYRL_TEST_PAUSE_AT=N: the N-th call writes PATH.paused and blocks, so the test can SIGKILL
      every process in the middle of an iteration (a resumed run counts on from N, so it never pauses);
    - RALLYRL_TEST_KILL_RANK=R: the process of rank R SIGKILLs itself in its first call;
    - RALLYRL_TEST_HANG_RANK=R: rank R blocks in its first call (stuck, not dead).
    """
    kill = os.environ.get("RALLYRL_TEST_KILL_RANK")
    if kill is not None and int(kill) == _rank():
        os.kill(os.getpid(), signal.SIGKILL)
    hang = os.environ.get("RALLYRL_TEST_HANG_RANK")
    if hang is not None and int(hang) == _rank():
        time.sleep(600)  # its peers must be released by dist.timeout_s
    counter = os.environ.get("RALLYRL_TEST_COUNTER")
    if counter:
        path = Path(counter)
        n = (int(path.read_text()) if path.exists() else 0) + 1
        path.write_text(str(n))
        pause = os.environ.get("RALLYRL_TEST_PAUSE_AT")
        if pause and n == int(pause):
            Path(counter + ".paused").write_text(str(n))
            time.sleep(600)  # until the test kills every process of the run
    return hashed(samples, prompts, outputs, **kwargs)


def count_e(samples, prompts, outputs, **kwargs):
    return [o.count("e") / (1.0 + len(o)) for o in outputs]


def draw_from_global_rngs() -> float:
    """What a careless reward pipeline does: draw from every global RNG (torch CPU/CUDA, numpy, random)."""
    x = random.random() + float(np.random.rand(3).sum()) + float(torch.rand(5).sum()) + float(torch.randn(64).sum())
    if torch.cuda.is_available():
        x += float(torch.rand(3, device="cuda").sum())
    return x


def hashed_noisy(samples, prompts, outputs, **kwargs):
    """Same rewards as `hashed`, but it also moves every global RNG stream (e.g. reward-model dropout)."""
    draw_from_global_rngs()
    return hashed(samples, prompts, outputs, **kwargs)


def hashed_sharded(samples, prompts, outputs, **kwargs):
    """Same rewards as `hashed`, computed like a reward model sharded over the ranks: rank r scores the
    samples i with i % world == r, then an all-reduce (a real torch.distributed collective) combines
    them. It also checks that every rank was given the same batch, and draws random numbers."""
    import torch.distributed as tdist

    draw_from_global_rngs()
    _log_call(samples, kwargs)
    _check_aligned(samples, prompts, outputs, kwargs)
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    part = torch.zeros(len(samples), dtype=torch.float64)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        if i % world == rank:
            part[i] = deterministic_score(p, o)
    if world > 1:
        digest = hashlib.sha256("\x00".join(samples).encode()).hexdigest()
        everyone = [None] * world
        tdist.all_gather_object(everyone, digest)
        assert len(set(everyone)) == 1, "collective placement: ranks were given different batches"
        tdist.all_reduce(part, op=tdist.ReduceOp.SUM)  # x + 0.0 is exact: same floats as `hashed`
    return part.tolist()


def dense_ramp(samples, prompts, outputs, **kwargs):
    """A dense per-token reward over the first half of each output's tokens (shorter than the output),
    ramping up, whose SUM is deterministic_score(prompt, output)."""
    _log_call(samples, kwargs, fn="dense_ramp")
    out = []
    for p, o, ids in zip(prompts, outputs, kwargs["output_token_ids"]):
        s, m = deterministic_score(p, o), max(1, (len(ids) + 1) // 2)
        out.append([s * (t + 1) / (m * (m + 1) / 2) for t in range(m)])
    return out


def make_failing(on_rank: int = 0, message: str = "reward model exploded", stamp_dir: str | None = None):
    """A reward function (factory, for `reward.kwargs`) that raises on rank `on_rank` only; it writes the
    time it raised to `stamp_dir/raised.json` so a test can time how fast the whole run ends."""

    def failing_reward(samples, prompts, outputs, **kwargs):
        if _rank() == on_rank:
            if stamp_dir:
                Path(stamp_dir, "raised.json").write_text(json.dumps({"rank": _rank(), "time": time.time()}))
            raise ValueError(f"{message} (rank {_rank()})")
        return [deterministic_score(p, o) for p, o in zip(prompts, outputs)]

    return failing_reward


# ------------------------------------------------------------------------------------------------
# A tiny locally built sequence classifier, and a load-counting wrapper around hf_classifier


def build_tiny_classifier(out_dir, tokenizer_dir, *, n_embd: int = 64, n_layer: int = 2, seed: int = 0) -> Path:
    """A randomly initialised GPT2ForSequenceClassification with labels NEG/POS, saved with
    save_pretrained next to the tokenizer of `tokenizer_dir` (nothing is downloaded)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     num_labels=2, id2label={0: "NEG", 1: "POS"}, label2id={"NEG": 0, "POS": 1},
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(cfg)
    with torch.no_grad():  # a visible score scale (the default init gives logits near 0)
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    return out


def counted_classifier(log_dir: str, **kwargs):
    """`rallyrl.reward.hf_classifier(**kwargs)`, plus a per-process record in `log_dir/rank<R>.json` of
    how many times THIS process loaded a sequence-classification model (counted at transformers'
    `AutoModelForSequenceClassification.from_pretrained`, not by rallyrl's own bookkeeping), how many
    reward calls it made, and its peak RSS at exit."""
    import transformers

    from rallyrl.reward import hf_classifier

    state = {"rank": _rank(), "loads": 0, "calls": 0, "pid": os.getpid()}
    auto = transformers.AutoModelForSequenceClassification
    original = auto.from_pretrained.__func__

    def counting_from_pretrained(cls, *a, **kw):
        state["loads"] += 1
        return original(cls, *a, **kw)

    auto.from_pretrained = classmethod(counting_from_pretrained)
    fn = hf_classifier(**kwargs)
    # Built in the launcher too (its pre-flight check resolves the reward before any worker starts):
    # that process has no RANK and records itself apart.
    path = Path(log_dir, f"rank{state['rank']}.json" if "RANK" in os.environ else "launcher.json")

    def write() -> None:
        state["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        state["model_loaded"] = fn.loaded
        path.write_text(json.dumps(state))

    write()
    atexit.register(write)

    def classifier_reward(samples, prompts, outputs, **kw):
        state["calls"] += 1
        out = fn(samples, prompts, outputs, **kw)
        write()
        return out

    return classifier_reward


def huge(samples, prompts, outputs, **kwargs):
    """Finite but absurd rewards: the whitened advantages and the value loss overflow float32."""
    return [1e30 for _ in samples]


def slow_hashed(samples, prompts, outputs, **kwargs):
    """`hashed`, slowly (a window for sending the run a signal mid-iteration)."""
    time.sleep(float(os.environ.get("RALLYRL_TEST_SLEEP", "0.5")))
    return [deterministic_score(p, o) for p, o in zip(prompts, outputs)]


def hashed_slow(samples, prompts, outputs, **kwargs):
    """`hashed`, after sleeping RALLYRL_TEST_REWARD_SLEEP seconds per call (default 0.3): a slow reward
    model, for kill-and-restart tests and the overlap benchmark."""
    time.sleep(float(os.environ.get("RALLYRL_TEST_REWARD_SLEEP", "0.3")))
    return hashed(samples, prompts, outputs, **kwargs)


_swallowed_ctrl_c = False


def swallows_ctrl_c(samples, prompts, outputs, **kwargs):
    """`hashed`, but its first call sends this process SIGINT and swallows the KeyboardInterrupt, as a
    library with a bare ``except:`` (or a signal landing in a garbage-collection finalizer) would."""
    global _swallowed_ctrl_c
    if not _swallowed_ctrl_c:
        _swallowed_ctrl_c = True
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)  # the handler runs (and raises) here
        except KeyboardInterrupt:
            pass
    return hashed(samples, prompts, outputs, **kwargs)


def constant(samples, prompts, outputs, **kwargs):
    """The same score for every sample: every group of completions has zero spread."""
    return [0.5 for _ in samples]


def signalling(**_unused):
    """A factory (``reward.fn`` with any ``reward.kwargs``) of `hashed` that, when RALLYRL_TEST_SIGNAL is
    set, makes ONE rank send itself a pre-emption signal at a chosen point of the run, as a job
    scheduler would (tests/dist/test_preemption.py). RALLYRL_TEST_SIGNAL = "<where>:<rank>:<iteration>":

    - ``update:R:N``: rank R gets SIGTERM as it starts the PPO update of iteration N;
    - ``checkpoint:R:N``: rank R gets SIGUSR1 and then SIGTERM (a second signal) in the middle of writing
      checkpoint step_N (after its first file).

    Built on every rank (and in the launcher's pre-flight check, which has no RANK: nothing happens
    there); it wraps rallyrl's own functions, so the signal lands inside the real code path."""
    spec = os.environ.get("RALLYRL_TEST_SIGNAL")
    if spec and "RANK" in os.environ:
        where, rank, step = spec.split(":")
        if int(rank) == _rank():
            _arm(where, int(step))
    return hashed


def _arm(where: str, step: int) -> None:
    import rallyrl.run.checkpoint as ckpt
    import rallyrl.trainer as trainer

    if where == "update":
        original_update = trainer.ppo_update

        def ppo_update(*args, **kwargs):
            state = next(a for a in (*args, *kwargs.values()) if type(a).__name__ == "TrainState")
            if state.iteration + 1 == step:  # state.iteration is the last completed iteration
                os.kill(os.getpid(), signal.SIGTERM)
            return original_update(*args, **kwargs)

        trainer.ppo_update = ppo_update
    elif where == "checkpoint":
        original_save = ckpt._save_split
        fired = []

        def save_split(base, obj):
            out = original_save(base, obj)
            if base.parent.name == f".tmp_step_{step}" and not fired:
                fired.append(True)
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        ckpt._save_split = save_split
    else:
        raise ValueError(f"RALLYRL_TEST_SIGNAL: unknown point {where!r}")


def _text(x) -> str:
    """A TRL prompt or completion as text: a string, or the content of the last message of a list."""
    return x if isinstance(x, str) else x[-1]["content"]


def trl_unscorable(prompts, completions, completion_ids, answer, **kwargs):
    """A reward function written for TRL (keywords, a data column by name): None (unscorable) for a row
    without an answer and for about a quarter of the others (decided by the prompt and the completion,
    so the same wherever it runs), else `deterministic_score`."""
    _log_call(completions, kwargs)
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    out = []
    for p, c, a in zip(prompts, completions, answer):
        s = deterministic_score(_text(p), _text(c))
        out.append(None if a is None or s < 0.25 else s)
    return out
def hashed_pass_fail(samples, prompts, outputs, **kwargs):
    """A verifiable-looking 0/1 reward: 1 for about a quarter of (prompt, output) pairs (`hashed` < 0.25).
    Groups of 4 then often score all 0 (about 1 in 3): what DAPO's dynamic sampling discards."""
    return [float(s < 0.25) for s in hashed(samples, prompts, outputs, **kwargs)]


def pass_fail_noisy(samples, prompts, outputs, **kwargs):
    """`hashed_pass_fail`'s scores, moving every global RNG stream as `hashed_noisy` does."""
    return [float(s < 0.25) for s in hashed_noisy(samples, prompts, outputs, **kwargs)]


def pass_fail_sharded(samples, prompts, outputs, **kwargs):
    """`hashed_pass_fail`'s scores, computed over the ranks with a real collective (`hashed_sharded`)."""
    return [float(s < 0.25) for s in hashed_sharded(samples, prompts, outputs, **kwargs)]


def pass_fail_with_crashes(samples, prompts, outputs, **kwargs):
    """`hashed_pass_fail`'s scores with `hashed_with_crashes`' fault injection (pause, kill, hang)."""
    return [float(s < 0.25) for s in hashed_with_crashes(samples, prompts, outputs, **kwargs)]
