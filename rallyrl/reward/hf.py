"""A built-in reward function: a Hugging Face sequence classifier (a reward model), loaded lazily.

``hf_classifier(path, label=...)`` returns a callable reward function. Building it reads only the
model's ``config.json`` (so a wrong ``label`` is an error before training starts, on every rank); the
weights and tokenizer are loaded on the FIRST CALL, in the process that calls it. With
``reward.placement: main`` only rank 0 calls reward functions, so only rank 0 ever holds the reward model
— the "7+1" set-up (see docs/reward.md):

    reward:
      fn: rallyrl.reward:hf_classifier
      kwargs: {path: /models/sentiment-rm, label: POSITIVE, device: "cuda:7", batch_size: 64}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from ..config import DTYPES as _DTYPES  # the one dtype list; torch is imported when the model is loaded


class HFClassifierError(ValueError):
    """The classifier's options do not fit the model (unknown label, bad option value)."""


def _labels_text(id2label: dict[int, str]) -> str:
    return ", ".join(f"{i}={id2label[i]!r}" for i in sorted(id2label))


def resolve_label(label: str | int | None, id2label: dict[int, str], where: str) -> int:
    """The index of ``label`` (a name or an index) among the model's labels, or a clear error."""
    n = len(id2label)
    if label is None:
        if n == 1:  # a scalar reward model (num_labels=1): its only output is the reward
            return 0
        raise HFClassifierError(
            f"hf_classifier: the model at {where} has {n} labels ({_labels_text(id2label)}); "
            f"set label= to one of them (a name or an index)"
        )
    if isinstance(label, bool):
        raise HFClassifierError(f"hf_classifier: label must be a name or an index, got {label!r}")
    if isinstance(label, int):
        if not 0 <= label < n:
            raise HFClassifierError(
                f"hf_classifier: label index {label} is out of range for the model at {where}, which has "
                f"{n} label(s): {_labels_text(id2label)}"
            )
        return label
    if isinstance(label, str):
        for i, name in id2label.items():
            if name == label:
                return int(i)
        raise HFClassifierError(
            f"hf_classifier: label {label!r} is not a label of the model at {where}; its labels are "
            f"{_labels_text(id2label)}"
        )
    raise HFClassifierError(f"hf_classifier: label must be a name or an index, got {type(label).__name__}")


class HFClassifierReward:
    """Reward = the logit (or probability) of one label of a sequence classifier, per sample.

    Loaded on the first call (``loaded`` tells whether it has been); ``loads`` counts the loads (1 at
    most). Calls run under ``torch.inference_mode()`` with the model in eval mode (no dropout).
    """

    def __init__(
        self,
        path: str,
        label: str | int | None = None,
        *,
        batch_size: int = 32,
        device: str | None = None,
        max_length: int | None = None,
        output: Literal["logit", "prob"] = "logit",
        text: Literal["sample", "output"] = "sample",
        dtype: str = "float32",
        tokenizer_path: str | None = None,
    ) -> None:
        from transformers import AutoConfig

        if output not in ("logit", "prob"):
            raise HFClassifierError(f"hf_classifier: output must be 'logit' or 'prob', got {output!r}")
        if text not in ("sample", "output"):
            raise HFClassifierError(f"hf_classifier: text must be 'sample' or 'output', got {text!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise HFClassifierError(f"hf_classifier: batch_size must be a positive integer, got {batch_size!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise HFClassifierError(f"hf_classifier: max_length must be a positive integer, got {max_length!r}")
        if dtype not in _DTYPES:
            raise HFClassifierError(f"hf_classifier: dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        self.path, self.tokenizer_path = str(path), str(tokenizer_path or path)
        self.batch_size, self.max_length, self.output, self.text, self.dtype = (
            batch_size, max_length, output, text, dtype)
        self.device = device  # resolved at load time (None: "cuda" if available, else "cpu")
        # Only config.json is read here (every rank builds the function; only callers load weights).
        try:
            self.config = AutoConfig.from_pretrained(self.path)
        except Exception as e:
            raise HFClassifierError(f"hf_classifier: cannot read the model config at {self.path}: {e}") from e
        self.id2label = {int(i): str(n) for i, n in self.config.id2label.items()}
        self.label_index = resolve_label(label, self.id2label, self.path)
        self.label = self.id2label[self.label_index]
        self.model: Any = None
        self.tokenizer: Any = None
        self.loads = 0
        self.__name__ = "hf_classifier"  # the metric name when passed as rallyrl.train(reward_fn=...)

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def __repr__(self) -> str:
        return (f"hf_classifier({self.path!r}, label={self.label!r}, output={self.output!r}, text={self.text!r}, "
                f"device={self.device!r}, loaded={self.loaded})")

    def load(self) -> None:
        """Load tokenizer and weights (done by the first call; callable directly to load early)."""
        import torch
        import transformers
        from transformers import AutoTokenizer

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise HFClassifierError(
                    f"hf_classifier: the tokenizer at {self.tokenizer_path} has neither a pad nor an eos token; "
                    f"batched scoring needs one"
                )
            tok.pad_token = tok.eos_token
        # `dtype=` replaced `torch_dtype=` in transformers 4.56.
        new_kw = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
        kw = {"dtype" if new_kw else "torch_dtype": getattr(torch, self.dtype)}
        # No per-file progress bars in the middle of a training log (as the trainer does for the policy).
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        try:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(self.path, **kw)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        if model.config.pad_token_id is None:  # GPT-2-style models find the last real token by pad id
            model.config.pad_token_id = tok.pad_token_id
        self.model, self.tokenizer = model.to(device).eval(), tok
        self.loads += 1

    def _limit(self) -> int | None:
        if self.max_length is not None:
            return self.max_length
        from ..models import max_positions

        known = [max_positions(self.config), getattr(self.tokenizer, "model_max_length", None)]
        known = [int(k) for k in known if isinstance(k, int) and 0 < k < 1_000_000]
        return min(known) if known else None

    def __call__(self, samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str],
                 **kwargs: Any) -> list[float]:
        import torch

        if self.model is None:
            self.load()
        texts = list(samples if self.text == "sample" else outputs)
        limit = self._limit()
        device = next(self.model.parameters()).device
        multi_label = self.config.problem_type == "multi_label_classification"
        scores: list[float] = []
        with torch.inference_mode():
            for a in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[a : a + self.batch_size], padding=True, return_tensors="pt",
                                     truncation=limit is not None, max_length=limit)
                logits = self.model(**{k: v.to(device) for k, v in enc.items()}).logits.float()  # (b, L)
                if self.output == "prob":
                    # One output (a scalar reward model) or independent labels: sigmoid; else softmax.
                    probs = logits.sigmoid() if (logits.shape[-1] == 1 or multi_label) else logits.softmax(-1)
                    col = probs[:, self.label_index]
                else:
                    col = logits[:, self.label_index]
                scores.extend(float(x) for x in col.cpu())
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:  # validation would catch it too; this names the model as the source
            raise HFClassifierError(f"hf_classifier: the model at {self.path} gave non-finite scores for samples {bad}")
        return scores


def hf_classifier(path: str, label: str | int | None = None, **options: Any) -> HFClassifierReward:
    """A reward function scoring each sample with a local Hugging Face sequence classifier.

    - ``path``: folder of an ``AutoModelForSequenceClassification`` (+ tokenizer, unless
      ``tokenizer_path``).
    - ``label``: the label whose score is the reward, by name (``config.id2label``) or index; may be
      omitted for a model with a single output (num_labels=1). An unknown label is an error listing the
      model's labels.
    - ``output``: ``logit`` (default) or ``prob`` (softmax over the labels; sigmoid for a single output or
      a multi-label model).
    - ``text``: ``sample`` (prompt + output, default) or ``output`` (the response alone).
    - ``batch_size``: the classifier's own forward batch (independent of ``reward.batch_size``, which
      sizes the calls rallyrl makes).
    - ``device``: e.g. ``cuda:7`` (default: ``cuda`` if available, else ``cpu``); ``dtype``: float32,
      bfloat16 or float16.
    - ``max_length``: truncate inputs to this many tokens (default: the model's maximum positions);
      truncation follows the tokenizer's ``truncation_side``.

    Nothing but ``config.json`` is read until the first call, which loads the model in the calling
    process; with ``reward.placement: main`` that is rank 0 only. Options (keyword-only) are those of
    ``HFClassifierReward``; an unknown one is a TypeError naming it.
    """
    return HFClassifierReward(path, label, **options)
