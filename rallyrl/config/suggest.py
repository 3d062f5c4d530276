""""Did you mean": the rallyrl key an unknown key most likely is, always as a full dotted key.

In order: a peer's option name (``num_generations`` -> ``rollout.samples_per_prompt``, with what differs);
a nested key written flat (``model.lora_r`` -> ``model.lora.r``); a rallyrl key given in the wrong section
(``train.lr`` -> ``ppo.lr``); a near miss in its own section (``ppo.lrr`` -> ``ppo.lr``); a near miss
anywhere (``ppo.temperatur`` -> ``generation.temperature``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing

from .peers import peer_option


@functools.lru_cache(maxsize=None)
def _leaves(cls: type) -> tuple[str, ...]:
    """Every non-section field under ``cls``, as dotted paths relative to it (``lora.r``); the entries
    of a list of sections (``reward.fns``) are not walked: their keys only exist inside an entry."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        out += [f"{f.name}.{p}" for p in _leaves(tp)] if dataclasses.is_dataclass(tp) else [f.name]
    return tuple(out)


def did_you_mean(k: str, cls: type, prefix: str, root: type) -> str:
    """The text after an unknown key ``prefix.k`` of section ``cls`` (``root``: the whole tree): `` (did
    you mean 'ppo.lr'? ...)``, or empty when nothing is close."""
    full = lambda rel: f"{prefix}.{rel}" if prefix else rel  # noqa: E731
    peer = peer_option(re.sub(r"\[\d+\]", "", full(k)))
    if peer is not None:
        note = f"; {peer.note}" if peer.note else ""
        return f" (did you mean {peer.key!r}? {peer.name} is the {peer.who} name for it{note})"
    nested = {p.replace(".", "_"): p for p in _leaves(cls) if "." in p}
    if k in nested:
        return f" (did you mean {full(nested[k])!r}?)"
    elsewhere = [p for p in _leaves(root) if p.rsplit(".", 1)[-1] == k]
    if elsewhere:
        return f" (did you mean {' or '.join(repr(p) for p in elsewhere)}?)"
    local = [f.name for f in dataclasses.fields(cls)]
    hint = difflib.get_close_matches(k, local + list(nested), n=1)
    if hint:
        return f" (did you mean {full(nested.get(hint[0], hint[0]))!r}?)"
    anywhere = {p.rsplit(".", 1)[-1]: p for p in reversed(_leaves(root))}
    hint = difflib.get_close_matches(k, list(anywhere), n=1)
    return f" (did you mean {anywhere[hint[0]]!r}?)" if hint else ""
