"""The benchmark tooling (benchmarks/): statistics, the iteration profile, the outside RSS monitor, the
TRL reward adapter, the configs it writes and the report it renders. No benchmark is run here, and no
timing is asserted (DESIGN.md rule 11)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench, common, ppo_vs_trl, reward_phase, smollm2_task, smollm2_vs_trl
from rallyrl.config import ConfigError, load_config


def test_steady_drops_warmup_and_needs_something_left():
    assert common.steady([9.0, 1.0, 2.0], 1) == [1.0, 2.0]
    with pytest.raises(common.BenchError, match="more than 2 warm-up"):
        common.steady([9.0, 1.0], 2)
    with pytest.raises(ValueError, match="warmup"):
        common.steady([1.0], -1)


def test_episodes_per_s_counts_only_steady_iterations():
    # 3 steady iterations of 8 episodes in 1 + 2 + 1 = 4 s; the 10 s warm-up is ignored
    assert common.episodes_per_s([10.0, 1.0, 2.0, 1.0], 8, 1) == pytest.approx(6.0)


def test_spread_and_median_ratio():
    assert common.spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert common.median_ratio([1.1, 1.3, 9.0], [1.0, 1.0, 0.5]) == pytest.approx(1.3)
    with pytest.raises(common.BenchError):
        common.spread([])


def _row(it, gen, fwd, rew, gather, upd, ev=None):
    r = {"time/iteration": it, "time/generate": gen, "time/forward": fwd, "time/reward": rew,
         "time/reward_gather": gather, "time/update": upd}
    if ev is not None:
        r["time/eval"] = ev
    return r


def test_loop_iteration_times_subtract_eval():
    assert common.loop_iteration_times([_row(2.0, 0, 0, 0, 0, 0), _row(3.0, 0, 0, 0, 0, 0, ev=0.5)]) == [2.0, 2.5]


def test_profile_means_add_up_to_the_iteration():
    rows = [
        _row(50.0, 40, 1, 1, 1, 1),  # warm-up, ignored
        _row(2.0, 0.4, 0.2, 0.1, 0.05, 1.0),
        _row(2.5, 0.6, 0.2, 0.2, 0.05, 1.2, ev=0.5),  # 2.0 s without its eval
        _row(3.5, 0.5, 0.5, 0.3, 0.10, 1.4),
    ]
    p = common.profile(rows, 1)
    assert p["iteration_s"] == pytest.approx(2.5)  # mean of 2.0, 2.0, 3.5
    ph = p["phases"]
    assert ph["generate"]["s"] == pytest.approx(0.5)
    assert ph["forward"]["s"] == pytest.approx(0.3)
    assert ph["reward"]["s"] == pytest.approx(0.8 / 3)  # (0.15 + 0.25 + 0.40) / 3
    assert ph["update"]["s"] == pytest.approx(1.2)
    assert ph["other"]["s"] == pytest.approx(2.5 - (0.5 + 0.3 + 0.8 / 3 + 1.2))
    assert ph["update"]["share"] == pytest.approx(1.2 / 2.5)
    assert sum(v["s"] for v in ph.values()) == pytest.approx(p["iteration_s"])


def test_interleaved_order_alternates():
    assert ppo_vs_trl.interleaved(("a", "b"), 0) == ["a", "b"]
    assert ppo_vs_trl.interleaved(("a", "b"), 1) == ["b", "a"]


def test_peak_rss_monitor_sees_each_rank_from_outside(tmp_path):
    """Two workers with RANK=0/1 under one parent: rank 0 touches 64 MiB more than rank 1."""
    child = ("import os, time; n = int(os.environ['MIB']); b = bytearray(n << 20); "
             "b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)")
    parent = (
        "import os, subprocess, sys\n"
        f"c = {child!r}\n"
        "ps = [subprocess.Popen([sys.executable, '-c', c], env={**os.environ, 'RANK': str(r), 'MIB': str(m)})\n"
        "      for r, m in ((0, 80), (1, 16))]\n"
        "sys.exit(max(p.wait() for p in ps))\n"
    )
    res = common.run_timed([sys.executable, "-c", parent], tmp_path / "log.txt", cwd=tmp_path, monitor=True)
    peaks = res["peak_rss_mib"]
    assert set(peaks) == {"0", "1"}
    assert peaks["0"] - peaks["1"] > 50
    assert peaks["1"] > 16


def test_run_timed_reports_failure_with_log(tmp_path):
    with pytest.raises(common.BenchError, match="(?s)exit code 3.*boom"):
        common.run_timed([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "l.txt",
                         cwd=tmp_path)


def test_text_reward_model_scores_what_trl_reads(tiny_model):
    """TRL's get_reward path: mask = tokens != pad, backbone(input_ids, attention_mask), score(hidden[-1]),
    read at the last response token. The adapter must put score(decoded real tokens) there."""
    import torch

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["the cat sat on the mat", "a dog", "good morning to you"]
    ids = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, ids)) + 2
    pad = tok.pad_token_id
    qr = torch.tensor([row + [pad] * (width - len(row)) for row in ids])  # (B, L), right-padded responses
    seen: list[list[str]] = []

    def score(ts: list[str]) -> list[float]:
        seen.append(ts)
        return [float(len(t)) for t in ts]

    rm = smollm2_task.make_text_reward_model(tok, score)
    mask = qr != pad
    out = getattr(rm, rm.base_model_prefix)(input_ids=torch.masked_fill(qr, ~mask, 0), attention_mask=mask,
                                            return_dict=True, output_hidden_states=True, use_cache=False)
    logits = rm.score(out.hidden_states[-1])  # (B, L, 1)
    last = torch.tensor([len(r) - 1 for r in ids])
    got = logits[torch.arange(len(texts)), last].squeeze(-1).tolist()
    assert seen == [texts]
    assert got == [float(len(t)) for t in texts]
    assert rm.backbone.calls == 1 and rm.backbone.samples == 3


def test_vader_reward_orders_sentiment():
    good, bad, flat = smollm2_task.reward_fn(["I love this wonderful film", "I hate this awful film", "a film"],
                                             ["", "", ""], ["", "", ""])
    assert good > 0.5 and bad < -0.5 and flat == 0.0


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("placement", ["main", "local"])
def test_reward_phase_configs_are_valid_and_one_round(tmp_path, world, placement):
    d = reward_phase.config(tmp_path / "p", tmp_path / "rm", tmp_path / "run", world, 3, placement=placement)
    cfg = load_config(d)
    assert cfg.reward.placement == placement
    assert cfg.rollout.num_rollouts == reward_phase.GLOBAL_ROLLOUTS
    assert cfg.rollout.chunk_size * world == cfg.rollout.num_rollouts  # one chunk round: one reward call
    assert cfg.reward.kwargs["batch_size"] == cfg.rollout.num_rollouts


def test_smollm2_config_matches_the_trl_settings(tmp_path):
    cfg = load_config(smollm2_vs_trl.rallyrl_config(str(tmp_path), str(tmp_path / "run"), 4))
    assert (cfg.rollout.num_rollouts, cfg.rollout.chunk_size) == (smollm2_vs_trl.EPISODES, smollm2_vs_trl.EPISODES)
    assert (cfg.ppo.epochs, cfg.ppo.num_minibatches) == (smollm2_vs_trl.EPOCHS, smollm2_vs_trl.MINIBATCHES)
    assert cfg.ppo.max_grad_norm is None and cfg.ppo.lr_schedule == "constant"
    assert cfg.generation.max_new_tokens == 32 and cfg.model.value_head_std == 0.0
    with pytest.raises(ConfigError):  # the strict loader would catch a typo in what the benchmark writes
        load_config({**smollm2_vs_trl.rallyrl_config(str(tmp_path), "r", 1), "ppo": {"epoch": 1}})


def _report(ratio: float, overhead: float) -> dict:
    s = {"min": 0.1, "median": 0.2, "max": 0.3, "n": 3}
    prof = {"iteration_s": 1.0, "phases": {k: {"s": 0.2, "share": 0.2} for k in
                                           ("generate", "forward", "reward", "update", "other")}}
    sysrow = {"episodes_per_s_median": 10.0, "final_score": [0.9], "profile": prof, "process_s": [30.0], "cpu_s": [20.0]}
    run = {"reward_step_s": s, "reward_fn_s": s, "reward_gather_s": s, "reward_calls_per_iteration": 1.0,
           "samples_per_call": 96.0, "iteration_s": s, "call_s_steady": s}
    return {
        "meta": {"date": "d0", "finished": "d1", "wall_s": 600.0, "quick": False, "command": "benchmarks/bench.py",
                 "machine": {"cpus": 2}, "versions": {"torch": "2.13.0+cpu"}, "git": {"commit": "abc"},
                 "load_start": 1.0, "load_end": 2.0},
        "ppo_vs_trl": {"randomwalks": {"rallyrl1": {**sysrow, "episodes_per_s_median": 10.0 * ratio},
                                       "trl1": sysrow, "ratio": ratio, "repeats": 3, "pretrained_score": 0.3},
                       "smollm2": {"error": "examples/sentiments/prepare.py:smollm2_dir is not in this checkout"}},
        "reward_phase": {"main": run, "direct": run, "local": run, "overhead_ratio": overhead,
                         "server": {"status": "not available (rallyrl.reward.server is not in this checkout)"},
                         "rss": {"main_rank0_mib": 900.0, "main_rank1_mib": 700.0, "main_difference_mib": 200.0,
                                 "local_rank0_mib": 900.0, "local_rank1_mib": 890.0,
                                 "reward_model_safetensors_mib": 86.7}},
        "scaling": {"1": run, "2": run, "3": run},
    }


def test_table_states_goals_failures_and_missing_parts():
    t = bench.table(_report(3.5, 1.4))
    assert "| **3.50** | >= 2.0 (met) |" in t
    assert "**1.40** (a/b) | <= 1.1 (NOT met) |" in t
    assert "ppo_vs_trl.smollm2 | (failed) | examples/sentiments/prepare.py:smollm2_dir" in t
    assert "not available" in t
    assert "900 / 700 (+200)" in t
    assert t.count("| scaling | world size") == 3
    assert "(NOT met)" in bench.table(_report(1.5, 1.05)).split("reward_phase")[0]


def test_results_md_names_machine_sharing_and_command():
    md = bench.results_md(_report(2.5, 1.0))
    assert "shared" in md and "benchmarks/bench.py" in md and "torch 2.13.0+cpu" in md and "10.0 min" in md


def test_same_work_contract_holds_for_both_rows_and_names_a_difference(tmp_path):
    from benchmarks import randomwalks_vs_trl as rw

    rw_cfg = rw.rallyrl_settings(tmp_path / "m", tmp_path / "r", 3)
    assert common.same_work_mismatches(rw_cfg, rw.trl_settings(tmp_path / "r", 3)) == []
    sm_cfg = load_config(smollm2_vs_trl.rallyrl_config(str(tmp_path), str(tmp_path / "r"), 3, 8, 32))
    trl = smollm2_vs_trl.trl_settings(tmp_path / "r", 3, 8, 32)
    assert common.same_work_mismatches(sm_cfg, trl) == []
    assert trl["optim"] == "adamw_torch_fused"  # TRL's default optimizer, as rallyrl's fused AdamW
    bad = dict(trl, num_ppo_epochs=2, response_length=16)
    got = common.same_work_mismatches(sm_cfg, bad)
    assert got == ["PPO epochs: rallyrl 1 vs TRL 2", "response length: rallyrl 32 vs TRL 16"]
    with pytest.raises(common.BenchError, match="not do the same work: PPO epochs"):
        common.check_same_work(sm_cfg, bad)
    # on 2 ranks TRL's per-device batch is half the episodes
    assert common.same_work_mismatches(rw_cfg, rw.trl_settings(tmp_path / "r", 3, world=2), world=2) == []


def test_runs_must_make_the_same_optimizer_steps():
    runs = [{"system": "trl1", "repeat": 1, "iterations": 3, "optimizer_steps": 6},
            {"system": "rallyrl1", "repeat": 1, "iterations": 3, "optimizer_steps": 6}]
    ppo_vs_trl.check_runs_did_the_same_work(runs)
    runs[1]["optimizer_steps"] = 4
    with pytest.raises(common.BenchError, match="same work"):
        ppo_vs_trl.check_runs_did_the_same_work(runs)


def test_trl_phase_clock_splits_an_iteration_by_what_trl_calls(monkeypatch):
    """A fake TRL module and a fake clock: each wrapped call advances time by a known amount, so the
    split is exact (no real timing)."""
    import types

    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])

    def costs(dt):
        def fn(*a, **k):
            now[0] += dt
            return "out"
        return fn

    class PolicyAndValueWrapper:
        pass

    reward_model, value_model = object(), object()
    mod = types.SimpleNamespace(batch_generation=costs(3.0), forward=costs(1.0), get_reward=costs(0.5),
                                gc=types.SimpleNamespace(collect=costs(0.25)))
    clock = common.TrlPhaseClock(mod, reward_model)
    clock.begin()
    assert mod.batch_generation("policy") == "out"  # generate 3
    mod.forward("ref")  # reference pass: forward 1
    mod.get_reward(value_model)  # critic at rollout time: forward 0.5
    mod.get_reward(reward_model)  # the reward adapter: reward 0.5
    mod.gc.collect()  # before the update: gc 0.25
    now[0] += 0.75  # advantages etc.: other
    mod.forward(PolicyAndValueWrapper())  # update starts here (1)
    mod.forward(types.SimpleNamespace(module=PolicyAndValueWrapper()))  # a DDP-wrapped one (1)
    mod.gc.collect()  # inside the update window: gc, not update
    now[0] += 2.0  # backward + optimizer
    clock.end_iteration()
    row = clock.rows[0]
    assert row == {"generate": 3.0, "forward": 1.5, "reward": 0.5, "update": 4.0, "gc": 0.5, "other": 0.75,
                   "iteration_s": 10.25}
    clock.end_iteration()  # an iteration with nothing in it
    assert clock.rows[1]["iteration_s"] == 0.0 and clock.rows[1]["update"] == 0.0
    prof = common.trl_profile(clock.rows[:1] * 3, warmup=1)
    assert prof["phases"]["update"]["s"] == 4.0 and sum(v["s"] for v in prof["phases"].values()) == 10.25


def test_table_shows_the_reward_server_rows_and_the_overlap_ratio():
    r = _report(2.5, 1.0)
    s = {"min": 1.0, "median": 2.0, "max": 3.0, "n": 2}
    r["reward_phase"]["server"] = {
        "url": "http://127.0.0.1:1", "rounds_per_iteration": 4,
        "server_overlap_false": {"reward_step_s": s, "iteration_s": s},
        "server_overlap_true": {"reward_step_s": s, "iteration_s": s},
        "ratio_overlap_to_sync": 0.8,
    }
    t = bench.table(r)
    assert "(d) `rallyrl serve-reward`, trainer, 2 processes, 4 rounds/iteration, overlap off" in t
    assert "(d) `rallyrl serve-reward`, trainer, 2 processes, 4 rounds/iteration, overlap on" in t
    assert "**0.80** (overlap/sync)" in t
    r["reward_phase"]["server"]["server_overlap_true"] = {"error": "boom\nmore"}
    del r["reward_phase"]["server"]["ratio_overlap_to_sync"]
    t = bench.table(r)
    assert "overlap on (s, median, min–max) | error: boom |" in t and "(overlap/sync)" not in t


@pytest.mark.parametrize("pairs", [1, 2])
def test_server_rows_run_the_asked_interleaved_pairs_and_pair_them_up(monkeypatch, tmp_path, pairs):
    """(d) runs off, on, off, on, ... for `pairs` pairs (QUICK: one), all against the one server, and the
    overlap ratio is the median of each pair's on / off."""

    class FakeServer:
        url = "http://127.0.0.1:1"
        closed = False

        def __init__(self, rm, log):
            pass

        def close(self):
            FakeServer.closed = True

    names, it = [], {False: 2.0, True: 1.5}

    def fake_run(cfg, world, out_dir, name):
        names.append(name)
        assert world == 2 and cfg["reward"]["url"] == FakeServer.url
        s = {"min": 1.0, "median": it[cfg["reward"]["overlap"]], "max": 3.0, "n": 1}
        return {"iteration_s": s, "reward_step_s": s, "reward_wait_s": None}

    monkeypatch.setattr(reward_phase, "RewardServer", FakeServer)
    monkeypatch.setattr(reward_phase, "run_rallyrl", fake_run)
    cfg = lambda name, world, **kw: reward_phase.config(tmp_path / "p", tmp_path / "rm", tmp_path / name, world, 2, **kw)  # noqa: E731
    rows = reward_phase.run_server_rows(tmp_path / "rm", tmp_path, cfg, pairs)
    assert names == [f"server_overlap_{o}_{k}" for k in range(pairs) for o in ("false", "true")]
    assert rows["pairs"] == pairs and len(rows["server_overlap_true"]["repeats"]) == pairs
    assert rows["ratio_overlap_to_sync"] == 0.75 and FakeServer.closed
    assert reward_phase.SERVER_PAIRS["quick"] == 1 and reward_phase.SERVER_PAIRS["full"] == 2


def test_table_reads_the_overhead_goal_from_the_median_of_the_pairs():
    rep = _report(2.5, 1.05)
    rep["reward_phase"]["overhead_pairs"] = [{"a_median_s": 0.9, "b_median_s": 0.8, "ratio": 1.125},
                                             {"a_median_s": 0.7, "b_median_s": 0.7, "ratio": 1.0},
                                             {"a_median_s": 0.8, "b_median_s": 0.76, "ratio": 1.05}]
    t = bench.table(rep)
    assert "**1.05** (a/b, median of 3 pairs) | <= 1.1 (met)" in t
    assert "0.900, 0.800, 1.12; 0.700, 0.700, 1.00; 0.800, 0.760, 1.05" in t
    assert "(first pair)" in t
    one = bench.table(_report(2.5, 1.2))  # a single pair (QUICK): no pair row
    assert "**1.20** (a/b) | <= 1.1 (NOT met)" in one and "per interleaved pair" not in one


def test_grpo_same_work_contract_holds_and_names_a_difference(tmp_path):
    from benchmarks import grpo_vs_trl as gv

    cfg = gv.rallyrl_settings(tmp_path / "m", tmp_path / "r", 3)
    trl = gv.trl_grpo_args(run_dir=tmp_path / "r", iterations=3)
    assert gv.same_work_mismatches(cfg, trl) == []
    assert trl["max_steps"] == 3 * cfg.ppo.num_minibatches and trl["beta"] == 0.0 and not trl["use_vllm"]
    bad = dict(trl, num_generations=4, loss_type="grpo")
    assert gv.same_work_mismatches(cfg, bad) == ["completions per prompt (G): rallyrl 8 vs TRL 4",
                                                 "loss aggregation: rallyrl 'token_mean' vs TRL 'seq_mean_token_mean'"]
    with pytest.raises(common.BenchError, match="not do the same work: completions per prompt"):
        gv.check_same_work(cfg, bad)


def test_grpo_clock_splits_an_iteration_by_the_trainer_methods(monkeypatch):
    from benchmarks import grpo_vs_trl as gv

    now = [0.0]
    monkeypatch.setattr(gv.time, "perf_counter", lambda: now[0])

    class Fake:
        def _generate(self):
            now[0] += 2.0

        def _calculate_rewards(self):
            now[0] += 0.5

        def _get_per_token_logps_and_entropies(self):
            now[0] += 1.0

        def _generate_and_score_completions(self):
            self._generate()
            self._get_per_token_logps_and_entropies()
            self._calculate_rewards()
            now[0] += 0.25

    t = Fake()
    clock = gv.TrlGrpoClock(t)
    clock.begin()
    t._generate_and_score_completions()
    t._get_per_token_logps_and_entropies()  # in the update: not "forward"
    now[0] += 3.0
    clock.end_iteration()
    assert clock.rows == [{"iteration_s": 7.75, "generate": 2.0, "forward": 1.0, "reward": 0.5, "other": 0.25,
                           "update": 4.0}]


@pytest.mark.parametrize("quick", [False, True])
def test_grpo_arithmetic_row_does_the_same_work(tmp_path, quick):
    from benchmarks import grpo_vs_trl as gv

    cfg = gv.rallyrl_settings(tmp_path / "m", tmp_path / "r", 3, "arithmetic", quick)
    trl = gv.trl_grpo_args(run_dir=tmp_path / "r", iterations=3, row="arithmetic", quick=quick)
    assert gv.same_work_mismatches(cfg, trl) == []
    assert trl["reward_weights"] == [1.0, 0.2] and trl["temperature"] == 0.7
    assert cfg.data.eval_prompts is None and cfg.rollout.chunk_size == cfg.rollout.num_rollouts
    assert gv.same_work_mismatches(cfg, dict(trl, reward_weights=[1.0, 1.0])) == [
        "reward functions' weights (summed, then group statistics): rallyrl [1.0, 0.2] vs TRL [1.0, 1.0]"]


# ------------------------------------------------------------------------------------------------
# floors: each phase against a bare-torch floor; bench.py merges sections into latest.json


def test_floor_phase_ratio_is_of_the_medians_and_pairs_are_kept():
    from benchmarks import floors

    r = floors.summarise_phase([1.2, 1.0, 3.0], [1.0, 0.5, 1.0])
    assert r["ratio"] == pytest.approx(2.0)  # pair ratios 1.2, 2.0, 3.0: their median, not the mean (2.07)
    assert r["ratio_of_medians"] == pytest.approx(1.2 / 1.0)
    assert r["pair_ratio"] == {"min": 1.2, "median": 2.0, "max": 3.0, "n": 3}
    assert r["rallyrl_s"]["median"] == 1.2 and r["floor_s"]["max"] == 1.0 and r["pairs"] == 3
    with pytest.raises(common.BenchError, match="as many"):
        floors.summarise_phase([1.0, 2.0], [1.0])
    with pytest.raises(common.BenchError, match="non-positive"):
        floors.summarise_phase([1.0], [0.0])
    assert [floors.pair_order(p)[0] for p in range(4)] == ["rallyrl", "floor", "rallyrl", "floor"]


def test_floor_configs_have_every_phase(tmp_path):
    """Both tasks' configs, as the worker builds them: a reference (KL), a value head, the policy's
    log-probs from a forward pass (so the scoring pass has a policy part) and clipping."""
    from benchmarks import floors, smollm2_vs_trl
    from benchmarks import randomwalks_vs_trl as rw

    rw_cfg = load_config(str(rw.CONFIG), [o for o in rw.rallyrl_overrides(tmp_path, tmp_path / "r", 1)
                                          if not o.startswith(("rollout.logprobs_from", "ppo.max_grad_norm"))]
                         + floors.FLOOR_OVERRIDES)
    sm_cfg = load_config(smollm2_vs_trl.rallyrl_config(str(tmp_path), str(tmp_path / "r"), 1, 8, 32),
                         floors.FLOOR_OVERRIDES)
    for cfg in (rw_cfg, sm_cfg):
        assert cfg.ppo.uses_reference and not cfg.ppo.critic_free
        assert cfg.rollout.logprobs_from == "forward" and cfg.ppo.max_grad_norm == 1.0


def _floors_report():
    phase = {"rallyrl_s": {"min": 1.0, "median": 1.05, "max": 1.3, "n": 5},
             "floor_s": {"min": 0.9, "median": 1.0, "max": 1.1, "n": 5}, "ratio": 1.05, "ratio_of_medians": 1.07,
             "pair_ratio": {"min": 0.9, "median": 1.04, "max": 1.2, "n": 5}, "pairs": 5}
    slow = {**phase, "ratio": 1.25}
    return {"goal_ratio": 1.1, "processes": 1,
            "randomwalks": {"phases": {"generate": phase, "update": slow}, "load_1min_start": 2.0,
                            "load_1min_end": 3.0},
            "smollm2": {"error": "worker failed\nstack"}}


def test_table_has_a_floor_row_per_task_and_phase_with_the_goal():
    t = bench.table({"floors": _floors_report()})
    assert "| floors.randomwalks | generate:" in t and "| **1.05** | <= 1.1 (met) |" in t
    assert "| floors.randomwalks | update:" in t and "| **1.25** | <= 1.1 (NOT met) |" in t
    assert "5 alternating pairs" in t and "2.0 / 3.0" in t and "ratio of the medians 1.07" in t
    assert "| floors.smollm2 | (failed) | worker failed |" in t


def test_running_one_section_keeps_the_others_results():
    old = {"meta": {"date": "2026-12-01"}, "ppo_vs_trl": {"randomwalks": {"ratio": 3.0}},
           "reward_phase": {"x": 1}, "scaling": {"1": {}}, "floors": {"old": True}}
    new = {"meta": {"date": "2026-12-04"}, "floors": {"new": True}}
    m = bench.merge_reports(old, new, ["floors"])
    assert m["floors"] == {"new": True} and m["ppo_vs_trl"] == old["ppo_vs_trl"]
    assert m["reward_phase"] == {"x": 1} and m["scaling"] == {"1": {}}
    assert m["meta"]["date"] == "2026-12-04"
    assert m["meta"]["earlier_sections"] == {"ppo_vs_trl": "2026-12-01", "reward_phase": "2026-12-01"}
    # a later run of ppo_vs_trl only: floors is now the earlier one, ppo_vs_trl is fresh
    m2 = bench.merge_reports(m, {"meta": {"date": "2026-12-05"}, "ppo_vs_trl": {"r": 1}}, ["ppo_vs_trl"])
    assert m2["meta"]["earlier_sections"] == {"reward_phase": "2026-12-01", "floors": "2026-12-04"}
    assert m2["floors"] == {"new": True} and m2["ppo_vs_trl"] == {"r": 1}
    assert bench.merge_reports(None, new, ["floors"]) is new
    full = _report(2.5, 1.0)
    merged = bench.merge_reports(full, {"meta": {**full["meta"], "date": "d9"}, "floors": _floors_report()}, ["floors"])
    md = bench.results_md(merged)
    assert "sections kept from earlier runs (not rerun by this command): ppo_vs_trl (d0), reward_phase (d0)" in md
    assert "| floors.randomwalks | generate:" in md and "| ppo_vs_trl.randomwalks |" in md


def test_grpo_arithmetic_vllm_row_differs_only_in_the_declared_engine(tmp_path):
    from benchmarks import grpo_vs_trl as gv

    cfg = gv.rallyrl_settings(tmp_path / "m", tmp_path / "r", 3, "arithmetic_vllm")
    trl = gv.trl_grpo_args(run_dir=tmp_path / "r", iterations=3, row="arithmetic_vllm")
    assert cfg.generation.engine == "vllm"
    assert gv.same_work_mismatches(cfg, trl) == [f"{gv.ENGINE_KEY}: rallyrl 'vllm' vs TRL 'hf'"]
    gv.check_same_work(cfg, trl, allowed=(gv.ENGINE_KEY,))  # declared: the row's one difference
