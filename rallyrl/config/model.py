"""`model:` (with `model.lora:`) and `data:`: what is trained, and on which prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .fields import DTYPES, REFERENCES, _f


@dataclass
class LoraConfig:
    r: int = _f(8, "LoRA rank (`model.reference: lora`).", gt=0)
    alpha: float = _f(16.0, "LoRA scaling numerator: the adapter's update is scaled by `alpha / r`.", gt=0)
    dropout: float = _f(
        0.0,
        "peft's `lora_dropout`. Only 0 is accepted: rallyrl runs the policy with dropout off (as TRL/OpenRLHF "
        "PPO), so the rollout's log-probs and the first PPO step's agree; the key exists so peft/trlx configs port.",
        ge=0, le=0,
        why="the policy runs with dropout off so the rollout's log-probs and the first PPO step's agree (ratio 1)",
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
        2, "`model.reference: shared`: how many top transformer blocks train (1 .. the model's layer count).",
        gt=0,
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
    prefill_once: bool = _f(
        True,
        "Run each distinct prompt of a batch once in the forward passes over rollouts (the scoring pass's "
        "old log-probs, values and reference log-probs, and every training micro-batch): a causal LM runs the "
        "prompt into a KV cache that its copies' responses read (gradients flow back through it), a seq2seq "
        "LM encodes it once. The G members of a group (`rollout.samples_per_prompt`) share a prompt, so this "
        "saves (G - 1) / G of the prompt work where a batch holds a whole group. The same log-probs, losses and "
        "gradients within float rounding, so the last bits of runs with repeated prompts change (set false for "
        "the earlier bits). Batches without a repeated prompt, one-token prompts, the `shared` reference and "
        "models whose cache is not plain full attention run the full forward. Generation has its own "
        "`generation.prefill_once` (the HF engine; vLLM caches prefixes itself). See docs/scaling.md.",
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
    max_prompt_tokens: int | None = _f(
        None, "The most tokens a prompt may have (as the run tokenizes it: after the chat template, with the "
        "tokenizer's special tokens for a plain prompt); null = the model's positions minus "
        "`generation.max_new_tokens` (no limit for a model without a position limit, e.g. T5). A longer prompt is "
        "handled by `data.long_prompts`. A value the model's positions cannot hold with `generation.max_new_tokens` "
        "is an error at start.", gt=0
    )
    long_prompts: Literal["error", "truncate_left", "skip"] = _f(
        "skip", "A prompt longer than `data.max_prompt_tokens`: `skip` leaves it out and draws the next prompt of "
        "the shared order in its place (every iteration keeps its prompt count; counted in `data/skipped_prompts`); "
        "`truncate_left` keeps its last `data.max_prompt_tokens` tokens (`data/truncated_prompts`); `error` checks "
        "every row at start, before any model loads (a length index cached beside the data), and refuses the run "
        "naming the row. docs/data.md."
    )

