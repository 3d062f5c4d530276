"""Multi-turn episodes: environment tokens from the chat template's delta (checked for prefix
preservation, on templates written out here the way Qwen/Hermes render tools), the turn loop over an
engine, the two masks, budgets, forks, and token-in/token-out against the policy's own forward."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoTokenizer

from rallyrl.rollout import Sampled, SamplingSpec
from rallyrl.config import GenerationConfig
from rallyrl.rollout.env import ChatRenderer, EnvRunner, EnvSetup, TemplateDrift, ToolEnv, env_factory, tool_schema
from rallyrl.rollout.episode import EnvFailure, run_env_episodes
from tests.helpers.chat import DROPS_THINK, QWEN_TOOLS


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


@pytest.fixture(scope="module")
def tok(tiny_chat):
    return AutoTokenizer.from_pretrained(tiny_chat)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
USER = [{"role": "user", "content": "what is 2 plus 3"}]


def test_delta_is_the_tool_turn_between_two_assistant_turns(tok):
    r = ChatRenderer(tok)  # no tools: the template renders no system block
    end = tok.convert_tokens_to_ids("<|im_end|>")
    conv = USER + [{"role": "assistant", "content": CALL}]
    tool = [{"role": "tool", "name": "add", "content": "5"}]
    # the model ended its turn itself (<|im_end|>, its EOS): the environment adds only what follows it
    delta = r.delta(conv, tool, enc(tok, CALL) + [end], turn=1)
    assert tok.decode(delta) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # cut by max_new_tokens (no end-of-turn sampled): the environment closes the turn too
    cut = r.delta(conv, tool, enc(tok, CALL), turn=1)
    assert cut == [end] + delta
    # query + sampled + delta is the whole conversation's render, token for token (the template is
    # prefix-preserving and the sampled ids re-encode the same here)
    q = r.ids(USER, True)
    full = r.ids(conv + tool, True)
    assert q + enc(tok, CALL) + [end] + delta == full


def test_tools_are_rendered_in_the_system_block(tok):
    r = ChatRenderer(tok, [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    text = r.text(USER, True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools") and '"name": "add"' in text
    assert text.endswith("<|im_start|>user\nwhat is 2 plus 3<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_drops_earlier_think_blocks_is_not_prefix_preserving(tok):
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = DROPS_THINK
    r = ChatRenderer(tok2)
    said = "<think>2 and 3</think>" + CALL
    conv = USER + [{"role": "assistant", "content": said}]
    with pytest.raises(TemplateDrift, match="not prefix-preserving at turn 2") as e:
        r.delta(conv, [{"role": "tool", "content": "5"}], enc(tok2, said), turn=2)
    assert "<think>" in str(e.value) and "env.on_template_drift: fork" in str(e.value)
    assert tok2.decode(e.value.rerendered).count("<think>") == 0  # what a fork's new row starts from
    # without a think block the same template is a fine delta
    conv = USER + [{"role": "assistant", "content": CALL}]
    assert r.delta(conv, [{"role": "tool", "content": "5"}], enc(tok2, CALL), turn=1)


class TurnEngine:
    """Answers the k-th call for an episode (found by the query its context starts with) with
    ``script[query][k]``, as a remote engine would hand back sampled ids; counts ready() entries."""

    def __init__(self, script):
        self.script, self.version, self.entered, self.batches = script, 3, 0, []
        self.turn = {q: 0 for q in script}

    @contextlib.contextmanager
    def ready(self):
        self.entered += 1
        yield

    def generate(self, prompts, spec):
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            q = max((q for q in self.script if tuple(p[: len(q)]) == q), key=len)
            out.append(list(self.script[q][self.turn[q]])[: spec.max_new_tokens])
            self.turn[q] += 1
        return Sampled(out, version=self.version)


def setup(factory, **kw):
    return EnvSetup(env_factory(factory), EnvRunner(5.0, 4), **kw)


def test_two_turn_tool_episode_rows_and_masks(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    records = [{"prompt": USER, "answer": 5}, {"prompt": [{"role": "user", "content": "say hi"}]}]
    r = ChatRenderer(tok, [tool_schema(add)])
    q0, q1 = r.ids(USER, True), r.ids(records[1]["prompt"], True)
    s_call, s_ans, s_hi = enc(tok, CALL) + [end], enc(tok, "it is 5") + [end], enc(tok, "hi") + [end]
    eng = TurnEngine({tuple(q0): [s_call, s_ans], tuple(q1): [s_hi]})
    ep = run_env_episodes(eng, tok, records, [7, 8], SamplingSpec(max_new_tokens=128, logprobs=True),
                          setup(lambda: ToolEnv([add]), turn_rewards="per_turn"))
    assert eng.entered == 1 and eng.batches == [2, 1]  # one ready() per round; turn 2 only for the running episode
    delta = r.delta(USER + [{"role": "assistant", "content": CALL}], [{"role": "tool", "name": "add", "content": "5"}],
                    s_call, 1)
    row0 = s_call + delta + s_ans
    n0 = len(row0)
    assert ep.query_ids[0, -len(q0):].tolist() == q0 and ep.response_ids[0, :n0].tolist() == row0
    am = [True] * len(s_call) + [False] * len(delta) + [True] * len(s_ans)
    assert ep.action_mask[0, :n0].tolist() == am and not ep.action_mask[0, n0:].any()
    assert ep.response_mask[0].tolist() == [True] * n0 + [False] * (ep.response_ids.shape[1] - n0)
    assert ep.action_mask[1].tolist()[: len(s_hi)] == [True] * len(s_hi) and ep.response_mask[1].sum() == len(s_hi)
    assert ep.row_episode == [0, 1] and ep.outputs == [tok.decode(s_call, skip_special_tokens=True) + "\nit is 5", "hi"]
    assert ep.response_lists == [row0, s_hi] and ep.version == 3
    t = ep.transcripts[0]
    assert [x["tokens"] for x in t["turns"]] == [len(s_call), len(s_ans)] and t["turns"][0]["env_tokens"] == len(delta)
    assert t["turns"][0]["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}, "result": "5", "error": None}]
    assert [m["role"] for m in t["messages"]] == ["user", "assistant", "tool", "assistant"] and not t["truncated"]
    assert ep.env_dense is not None and not ep.env_dense.any()  # ToolEnv gives no reward of its own
    assert ep.logprobs.shape == ep.response_ids.shape


class Guess:
    """A game: the model must say "7"; the environment answers "wrong" (reward 0) until it does (reward 1)."""

    def reset(self, record):
        return [{"role": "system", "content": "guess"}] if record.get("hint") else None

    def step(self, message):
        if message["content"].strip() == "7":
            return [], True, 1.0
        return [{"role": "user", "content": "wrong"}], False, -0.5


def test_rewards_per_turn_sit_on_each_turns_last_action_token(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    q = ChatRenderer(tok).ids(USER, True)
    a1, a2 = enc(tok, "5") + [end], enc(tok, "7") + [end]
    eng = TurnEngine({tuple(q): [a1, a2]})
    ep = run_env_episodes(eng, tok, [{"prompt": USER}], [0], SamplingSpec(max_new_tokens=8),
                          setup(Guess, turn_rewards="per_turn"))
    d = ep.transcripts[0]["turns"][0]["env_tokens"]
    dense = ep.env_dense[0].tolist()
    assert dense[len(a1) - 1] == -0.5 and dense[len(a1) + d + len(a2) - 1] == 1.0 and sum(dense) == 0.5
    assert ep.action_mask[0, len(a1) - 1] and ep.action_mask[0, len(a1) + d + len(a2) - 1]
    eng = TurnEngine({tuple(q): [a1, a2]})
    summed = run_env_episodes(eng, tok, [{"prompt": USER}], [0], SamplingSpec(max_new_tokens=8), setup(Guess))
    assert summed.env_scores == [0.5] and summed.env_dense is None
    assert summed.transcripts[0]["env_rewards"] == [-0.5, 1.0]


def test_budgets_end_episodes_as_truncated_never_a_crash(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    q = ChatRenderer(tok).ids(USER, True)
    wrong = enc(tok, "5") + [end]
    # env.max_turns: the environment would go on after the last allowed turn
    ep = run_env_episodes(TurnEngine({tuple(q): [wrong, wrong]}), tok, [{"prompt": USER}], [0],
                          SamplingSpec(max_new_tokens=8), setup(Guess, max_turns=2))
    t = ep.transcripts[0]
    assert t["truncated"] and len(t["turns"]) == 2 and ep.action_mask[0].sum() == 2 * len(wrong)
    # the episode budget: the environment's reply does not fit -> not appended, the episode ends
    ep = run_env_episodes(TurnEngine({tuple(q): [wrong, wrong]}), tok, [{"prompt": USER}], [0],
                          SamplingSpec(max_new_tokens=8), setup(Guess, max_tokens=len(q) + len(wrong) + 3))
    assert ep.transcripts[0]["truncated"] and ep.response_mask.sum() == len(wrong) and ep.action_mask.all()
    # a turn longer than the room left is cut to it (its sampled prefix kept exactly)
    long = enc(tok, "the cat sat on the mat") + [end]
    ep = run_env_episodes(TurnEngine({tuple(q): [long]}), tok, [{"prompt": USER}], [0],
                          SamplingSpec(max_new_tokens=64), setup(Guess, max_tokens=len(q) + 4))
    assert ep.response_ids[0].tolist() == long[:4] and ep.transcripts[0]["truncated"]
    with pytest.raises(ValueError, match="leaving no room"):
        run_env_episodes(TurnEngine({tuple(q): [wrong]}), tok, [{"prompt": USER}], [5], SamplingSpec(max_new_tokens=8),
                         setup(Guess, max_tokens=len(q)))


def test_drift_fails_clearly_or_forks_a_new_row(tok):
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = DROPS_THINK
    end = tok2.convert_tokens_to_ids("<|im_end|>")
    r = ChatRenderer(tok2)
    q = r.ids(USER, True)
    think = enc(tok2, "<think>hm</think>5") + [end]
    seven = enc(tok2, "7") + [end]
    with pytest.raises(EnvFailure, match=r"prompt 4, turn 1 \(Guess\): TemplateDrift: the chat template is not "
                                         r"prefix-preserving at turn 1"):
        run_env_episodes(TurnEngine({tuple(q): [think, seven]}), tok2, [{"prompt": USER}], [4],
                         SamplingSpec(max_new_tokens=64), setup(Guess))
    eng = TurnEngine({tuple(q): [think, seven]})
    ep = run_env_episodes(eng, tok2, [{"prompt": USER}], [4], SamplingSpec(max_new_tokens=64),
                          setup(Guess, on_template_drift="fork", turn_rewards="per_turn"))
    assert ep.row_episode == [0, 0] and ep.transcripts[0]["forks"] == 1
    # row 0: the first turn only (no environment tokens); row 1: the re-rendered conversation as its query
    assert ep.response_ids[0, : len(think)].tolist() == think and ep.response_mask[0].sum() == len(think)
    rerendered = r.ids(USER + [{"role": "assistant", "content": "<think>hm</think>5"},
                               {"role": "user", "content": "wrong"}], True)
    assert ep.query_ids[1, -len(rerendered):].tolist() == rerendered and "<think>" not in tok2.decode(rerendered)
    assert ep.response_ids[1, : len(seven)].tolist() == seven and ep.action_mask[1].sum() == len(seven)
    assert ep.env_dense[0, len(think) - 1] == -0.5 and ep.env_dense[1, len(seven) - 1] == 1.0
    assert ep.response_lists == [think + seven]


def test_environment_failures_name_the_prompt_and_turn(tok):
    q = ChatRenderer(tok).ids(USER, True)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class Broken(Guess):
        def step(self, message):
            raise KeyError("board")

    with pytest.raises(EnvFailure, match=r"prompt 9, turn 1 \(Broken\): KeyError: 'board'"):
        run_env_episodes(TurnEngine({tuple(q): [[end]]}), tok, [{"prompt": USER}], [9], SamplingSpec(max_new_tokens=8),
                         setup(Broken))

    def boom(a: int) -> int:
        raise RuntimeError("sandbox down")

    failing = EnvSetup(env_factory(lambda: ToolEnv([boom])), EnvRunner(5.0, 4, on_error="fail"))
    call = enc(tok, '<tool_call>{"name": "boom", "arguments": {"a": 1}}</tool_call>') + [end]
    q = ChatRenderer(tok, [tool_schema(boom)]).ids(USER, True)  # ToolEnv's tools are in the system block
    with pytest.raises(EnvFailure, match=r"prompt 2, turn 1 \(ToolEnv\): tool 'boom' failed: RuntimeError: sandbox down"):
        run_env_episodes(TurnEngine({tuple(q): [call]}), tok, [{"prompt": USER}], [2], SamplingSpec(max_new_tokens=128),
                         failing)


def test_hf_engine_multi_turn_logprobs_are_the_forward_over_the_row(tiny_chat):
    """Token in, token out across turns: the log-probs the engine computed while sampling each turn (with
    the environment's tokens in its context) equal the policy's forward over the finished row, on every
    action token: no position is shifted by the environment spans."""
    from rallyrl.config import ModelConfig
    from rallyrl.models import load_models
    from rallyrl.rollout import HFEngine, score_tokens

    models = load_models(ModelConfig(path=str(tiny_chat)), seed=0)
    torch.manual_seed(0)
    engine = HFEngine(models.policy, models.tokenizer, torch.device("cpu"))
    spec = SamplingSpec.of(GenerationConfig(max_new_tokens=6), True, models.tokenizer, logprobs=True)
    ep = run_env_episodes(engine, models.tokenizer, [{"prompt": USER}, {"prompt": USER}], [0, 1], spec,
                          setup(Guess, max_turns=3))
    assert all(len(t["turns"]) >= 2 for t in ep.transcripts)  # random words are never "7": several turns
    assert (~ep.action_mask & ep.response_mask).any()  # environment tokens inside the rows
    scored = score_tokens(models.policy, None, ep, 1.0, torch.device("cpu"))
    torch.testing.assert_close(ep.logprobs[ep.action_mask], scored.logprobs[ep.action_mask], atol=1e-4, rtol=0)
    assert (ep.logprobs[~ep.action_mask] == 0).all() and (scored.logprobs[~ep.action_mask] == 0).all()
