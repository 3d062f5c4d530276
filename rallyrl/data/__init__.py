"""Prompts: loading, the store, the shared order, and what the model is given (docs/data.md).

A prompt record is a dict with a ``"prompt"`` and any number of metadata columns; the metadata reaches
the reward function as per-sample lists aligned with the samples. The prompt is a string, or a
conversation: a list of chat messages (``[{"role": "user", "content": ...}, ...]``), which ``PromptSet``
renders with the tokenizer's chat template (it needs the tokenizer, loading does not).

Prompts live in one store, a ``PromptTable`` read by global row index (``open_prompts``). An inline list
is small by nature and stays a list of Python records, checked up front. Every file or data set goes
through ``datasets``: an Arrow table, memory-mapped from the datasets cache (the conversion of a file
happens once, under datasets' lock, and every rank on a node maps the same cache file), so no rank holds
Python objects for the whole data set. ``datasets`` is imported only when such a source is used.

The modules: ``records`` (the Python reader, message checks), ``tables`` (``PromptTable`` and its two
kinds), ``sources`` (``open_prompts``: files, folders, data set names, ``datasets`` objects), ``sampler``
(the shared order), ``render`` (chat template, token ids, the length rule ``PromptLimit``), ``prompt_set``
(``PromptSet``: rows drawn, prepared, skipped or truncated) and ``lengths`` (the cached length index).
"""

from .prompt_set import PromptSet
from .records import MESSAGES_KEY, DataError, check_messages, load_prompts
from .render import LONG_PROMPTS, PromptLimit, render_prompts, tokenize_prompts
from .sampler import PromptSampler
from .sources import FILE_SUFFIXES, PromptSource, open_prompts
from .tables import ArrowTable, ListTable, PromptTable

__all__ = ["FILE_SUFFIXES", "LONG_PROMPTS", "MESSAGES_KEY", "ArrowTable", "DataError", "ListTable", "PromptLimit",
           "PromptSampler", "PromptSet", "PromptSource", "PromptTable", "check_messages", "load_prompts",
           "open_prompts", "render_prompts", "tokenize_prompts"]
