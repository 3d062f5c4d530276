"""model.sharding: fsdp with the references that run the policy's own weights (`model.reference: shared`:
frozen top-block copies over the policy's frozen trunk; `lora`: the policy with its adapter off), on 2
processes (gloo, CPU), tiny GPT-2 and tiny Llama: KL exactly 0 at step 1, the same training as ddp
within float tolerance at half the bytes per rank, a final/ folder plain transformers (and PEFT) loads,
exact resume after SIGKILL and resharding onto 3 processes, and bf16 + gradient checkpointing."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, kill_when_paused, rallyrl_train, resume_latest, write_config

pytestmark = pytest.mark.dist

COMPARED = ("policy/loss", "value/loss", "policy/total_loss", "policy/grad_norm", "policy/kl", "policy/clipfrac",
            "policy/approx_kl", "reward/mean", "value/mean")

CASES = {  # id -> (model fixture, model.* settings)
    "shared-gpt2": ("tiny_model", {"reference": "shared", "num_layers_unfrozen": 1}),  # tied head, untied by shared
    "shared-llama": ("tiny_llama", {"reference": "shared", "num_layers_unfrozen": 1}),  # rotary, untied head
    "lora": ("tiny_model", {"reference": "lora", "lora": {"r": 4, "merge_on_save": True}}),
}


def _cfg(model, run_dir, sharding, model_cfg, **sections):
    # Greedy decoding: a rollout then depends on the weights only, so samples compare across shardings
    # and world sizes (as tests/dist/test_fsdp.py).
    cfg = base_config(model, run_dir, train={"iterations": 2}, checkpoint={"interval": 1, "keep_last": 2},
                      generation={"do_sample": False},
                      ppo={"target_kl": 0.5, "reward_scaling": "running", "max_grad_norm": 0.5},
                      reward={"fn": "tests.helpers.rewards:hashed_with_crashes"})
    cfg["model"].update(sharding=sharding, **model_cfg)
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Per case, an uninterrupted 2-process ddp run and the same run with fsdp (2 iterations, 4 optimizer
    steps each): {case: {"ddp": run_dir, "fsdp": run_dir, "model": model folder}}."""
    tmp = tmp_path_factory.mktemp("fsdp_refs")
    out = {}
    for case, (fixture, model_cfg) in CASES.items():
        model = request.getfixturevalue(fixture)
        out[case] = {"model": model}
        for sharding in ("ddp", "fsdp"):
            run = tmp / f"{case}-{sharding}"
            cfg = write_config(tmp / f"{case}-{sharding}.yaml", _cfg(model, run, sharding, model_cfg))
            proc = rallyrl_train(cfg, 2)
            assert proc.returncode == 0, proc.stderr[-4000:]
            out[case][sharding] = run
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_first_kl_is_zero_and_fsdp_trains_like_ddp_with_half_the_bytes(runs, case):
    ddp, fsdp = (read_jsonl(runs[case][s] / "metrics.jsonl") for s in ("ddp", "fsdp"))
    assert [m["step"] for m in ddp] == [m["step"] for m in fsdp] == [1, 2]
    # Before any update the reference is the policy: the same weights compute the same logits, exactly.
    assert fsdp[0]["policy/kl"] == 0.0 and ddp[0]["policy/kl"] == 0.0
    assert fsdp[1]["policy/kl"] != 0.0  # the policy moved away from its reference
    for a, b in zip(ddp, fsdp):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k, a[k], b[k])
    ra, rb = (read_jsonl(runs[case][s] / "rollouts.jsonl") for s in ("ddp", "fsdp"))
    assert [(r["step"], r["index"], r["output"]) for r in ra] == [(r["step"], r["index"], r["output"]) for r in rb]
    # rank 0 holds about half of the parameters (policy + value head + the reference's own copies;
    # none for lora) and half of the AdamW state (the trained parameters only)
    for a, b in zip(ddp, fsdp):
        assert a["memory/params_bytes"] > 0 and a["memory/optimizer_bytes"] > 0
        assert 0.45 < b["memory/params_bytes"] / a["memory/params_bytes"] < 0.55, (a, b)
        assert 0.45 < b["memory/optimizer_bytes"] / a["memory/optimizer_bytes"] < 0.55, (a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_final_is_the_ddp_runs_and_loads_with_transformers(runs, case):
    from transformers import AutoModelForCausalLM

    model = runs[case]["model"]
    finals = {s: AutoModelForCausalLM.from_pretrained(runs[case][s] / "final") for s in ("ddp", "fsdp")}
    a, b = finals["ddp"].state_dict(), finals["fsdp"].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert any(not torch.equal(initial[k], b[k]) for k in b)  # it trained
    saved = {s: load_file(runs[case][s] / "final" / "model.safetensors") for s in ("ddp", "fsdp")}
    assert saved["ddp"].keys() == saved["fsdp"].keys()
    if CASES[case][1]["reference"] == "shared":
        lm = finals["fsdp"]
        # the trunk (embeddings, bottom block) never moved; the head trained (untied from the embeddings)
        assert lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight
        emb = "transformer.wte.weight" if "transformer.wte.weight" in b else "model.embed_tokens.weight"
        assert torch.equal(b[emb], initial[emb])
        assert not torch.equal(b["lm_head.weight"], initial["lm_head.weight"])
    else:  # lora with merge_on_save: the merged model in final/, the adapter (PEFT) in final/adapter/
        from peft import PeftModel

        adapter = {s: load_file(runs[case][s] / "final" / "adapter" / "adapter_model.safetensors")
                   for s in ("ddp", "fsdp")}
        assert adapter["ddp"].keys() == adapter["fsdp"].keys() and adapter["fsdp"]
        for k in adapter["ddp"]:
            torch.testing.assert_close(adapter["fsdp"][k], adapter["ddp"][k], rtol=1e-4, atol=1e-5, msg=k)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model),
                                            runs[case]["fsdp"] / "final" / "adapter").eval()
        ids = torch.tensor([[5, 9, 13, 2, 7]])
        with torch.no_grad():
            torch.testing.assert_close(adapted(ids).logits, finals["fsdp"].eval()(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["shared-gpt2", "lora"])
def test_fsdp_resume_after_sigkill_is_bit_identical(runs, case, tmp_path):
    model, model_cfg = runs[case]["model"], CASES[case][1]
    cfg_b = write_config(tmp_path / "b.yaml", _cfg(model, tmp_path / "B", "fsdp", model_cfg))
    # 2 chunk rounds per iteration: reward call 4 is the 2nd round of iteration 2 (after checkpoint 1)
    cmd, e = kill_when_paused(cfg_b, 2, tmp_path / "calls", pause_at=4)
    assert sorted(p.name for p in (tmp_path / "B" / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["step_1"]

    resume_latest(cmd, e)

    full, resumed = runs[case]["fsdp"], tmp_path / "B"
    for name in ("model.safetensors", *(["adapter/adapter_model.safetensors"] if case == "lora" else [])):
        a, b = load_file(full / "final" / name), load_file(resumed / "final" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    ma, mb = read_jsonl(full / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [strip(m) for m in ma] == [strip(m) for m in mb]
    # the resumed weights (frozen ones included) and optimizer state are the uninterrupted run's
    for name in ("shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"):
        sa = load_file(full / "checkpoints" / "step_2" / "sharded" / name)
        sb = load_file(resumed / "checkpoints" / "step_2" / "sharded" / name)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
        assert any(k.startswith("optim.") for k in sa)


@pytest.mark.parametrize("case", ["lora", "shared-gpt2"])
def test_fsdp_resume_on_three_processes(runs, case, tmp_path):
    """The 2-process fsdp run's step_1 resumed on 3 processes: DCP reshards the frozen and the trained
    weights and the optimizer state; greedy decoding makes iteration 2's samples a function of the
    weights alone, so the same outputs as the uninterrupted run's show the resharding was exact."""
    model, model_cfg = runs[case]["model"], CASES[case][1]
    run = tmp_path / "B"
    shutil.copytree(runs[case]["fsdp"], run, ignore=shutil.ignore_patterns("step_2", "final"))
    cfg = _cfg(model, run, "fsdp", model_cfg, train={"resume": "latest"})
    proc = rallyrl_train(write_config(tmp_path / "b.yaml", cfg), 3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("the run continues from step 1 on 3 processes (was 2)") == 1, proc.stderr[-3000:]
    ra = [r for r in read_jsonl(runs[case]["fsdp"] / "rollouts.jsonl") if r["step"] == 2]
    rb = [r for r in read_jsonl(run / "rollouts.jsonl") if r["step"] == 2]
    assert {r["rank"] for r in rb} == {0, 1, 2}
    assert sorted((r["index"], r["output"]) for r in rb) == sorted((r["index"], r["output"]) for r in ra)
    ma, mb = read_jsonl(runs[case]["fsdp"] / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    for k in ("reward/mean", "policy/kl", "value/mean", "policy/response_length"):
        assert mb[1][k] == pytest.approx(ma[1][k], rel=1e-4, abs=1e-6), k
    assert mb[1]["policy/optimizer_steps"] == 8


@pytest.mark.parametrize("case, sharding", [("shared-llama", "fsdp"), ("lora", "fsdp"), ("lora", "ddp")])
def test_bf16_and_gradient_checkpointing(runs, case, sharding, tmp_path):
    """train.mixed_precision: bf16 with model.gradient_checkpointing: the reference computes as the
    policy does (FSDP2's bf16 parameters under fsdp; autocast under ddp, which the lora reference, holding
    no parameters of its own, gets too), so the first KL is still exactly 0; the weights stay float32."""
    model, model_cfg = runs[case]["model"], CASES[case][1]
    cfg = _cfg(model, tmp_path / "run", sharding, {**model_cfg, "gradient_checkpointing": True},
               train={"mixed_precision": "bf16"}, checkpoint={"interval": 0})
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert m[0]["policy/kl"] == 0.0 and m[1]["policy/kl"] != 0.0
    assert m[1]["policy/optimizer_steps"] == 8
    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


@pytest.mark.parametrize("case", ["shared-gpt2", "lora"])
def test_fsdp_with_logprobs_from_generate(runs, case, tmp_path):
    """rollout.logprobs_from: generate: the policy's log-probs come from the gathered generation and the
    scoring pass runs only the reference (with the policy gathered for it); iteration 1 equals the fsdp
    run's (whose log-probs come from a forward pass) up to the KV-cached math's float rounding."""
    model, model_cfg = runs[case]["model"], CASES[case][1]
    cfg = _cfg(model, tmp_path / "gen", "fsdp", model_cfg, rollout={"logprobs_from": "generate"},
               train={"iterations": 1, "save_final": False}, checkpoint={"interval": 0})
    proc = rallyrl_train(write_config(tmp_path / "gen.yaml", cfg), 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = read_jsonl(runs[case]["fsdp"] / "metrics.jsonl")[0], read_jsonl(tmp_path / "gen" / "metrics.jsonl")[0]
    for k in COMPARED:
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-4), (k, a[k], b[k])
    outputs = [[r["output"] for r in read_jsonl(d / "rollouts.jsonl") if r["step"] == 1]
               for d in (runs[case]["fsdp"], tmp_path / "gen")]
    assert outputs[0] == outputs[1]
