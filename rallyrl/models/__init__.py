"""Models behind two protocols (``Policy``, ``Reference``; see ``base.py``), their implementations and
the one loader.

The trainer and the rollout code talk to models only through ``Policy.forward`` / ``Policy.generate``
and ``Reference.logprobs``; how a model lays out query and response (a causal LM concatenates them, a
seq2seq model encodes the query and decodes the response) stays inside its implementation. Adding a
model type means implementing the two protocols and choosing it in ``loading.load_models``
(docs/models.md).
"""

from .base import Policy, Reference, make_value_head
from .causal import CausalPolicy, CopyReference
from .seq2seq import Seq2SeqCopyReference, Seq2SeqPolicy
from .loading import LoadedModels, ModelLoadError, check_model_folder, load_models, load_tokenizer, max_positions

__all__ = ["CausalPolicy", "CopyReference", "LoadedModels", "ModelLoadError", "Policy", "Reference",
           "Seq2SeqCopyReference", "Seq2SeqPolicy",
           "check_model_folder", "load_models", "load_tokenizer", "make_value_head", "max_positions"]
