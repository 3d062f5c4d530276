"""Reference documentation: docs/config.md is generated from the field docs (`python -m rallyrl.config
--markdown > docs/config.md`; a test fails when the page and the code disagree)."""

from __future__ import annotations

import dataclasses
import typing

import yaml

from .fields import type_name as _type_name
from .algorithm import GenerationConfig, VLLMConfig
from .model import LoraConfig, ModelConfig
from .peers import PEER_OPTIONS
from .reward import OverlongBufferConfig, RewardConfig, RewardFnSpec
from .root import Config


def _default_repr(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(v):
            return "see below"
        return yaml.safe_dump(v, default_flow_style=True).strip()
    return ""


def _sub_table(title: str, cls: type, prefix: str) -> list[str]:
    """The markdown table of a nested config dataclass (``model.lora``, each ``reward.fns`` entry)."""
    lines = [title, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _type_name(hints[f.name]).replace("|", "\\|")
        lines.append(f"| `{prefix}{f.name}` | {tp} | `{_default_repr(f)}` | {f.metadata.get('doc', '')} |")
    return lines + [""]


_INTRO = [
    "# Configuration reference",
    "",
    "Generated from `rallyrl/config/` (`python -m rallyrl.config --markdown > docs/config.md`); a test",
    "fails when this page and the code disagree. Every key can be set in the YAML file or on the",
    "command line with `--set section.key=value` (the value is parsed as YAML). Unknown keys and wrong",
    "types are errors naming the key, raised before any model is loaded.",
    "",
    "## Values",
    "",
    "rallyrl reads YAML 1.2 (its core schema), as editors and JSON do, so the JSON schema below and the",
    "loader judge the same values (a test checks every key with every kind of value):",
    "",
    "- `3e-5` is a number. YAML 1.1 parsers (PyYAML's `yaml.safe_load`) read it as text; a number given as",
    "  text (`\"3e-5\"`, or a dict read that way) is refused, naming that cause.",
    "- `2.0` is 2 where a key is an integer (JSON cannot tell them apart); `1.5` is refused.",
    "- Booleans are `true` / `false`. A plain `yes`, `no`, `on` or `off`, and a number YAML 1.1 reads",
    "  otherwise (`1_000`, `010`, `1:30`), is an error naming both readings: write `true` / `1000`, or quote",
    "  the text (`mixed_precision: 'no'`).",
    "- A choice is one of its exact strings; `null` is accepted where the type below says `null`; numbers",
    "  are finite (`.nan` and `.inf` are refused).",
    "",
    "## Editor support: the JSON Schema",
    "",
    "`rallyrl schema` prints a JSON Schema (draft 2020-12) of this whole page: every key with its type,",
    "choices, default, range and meaning. Save it once per rallyrl version and name it on a config's first",
    "line; editors that use the YAML language server (VS Code's YAML extension, Neovim, JetBrains, Helix, Zed)",
    "then complete keys, show each key's meaning on hover and mark a wrong type, a misspelled choice or a",
    "value out of range as you type:",
    "",
    "```bash",
    "rallyrl schema > rallyrl-config.schema.json",
    "```",
    "",
    "```yaml",
    "# yaml-language-server: $schema=rallyrl-config.schema.json",
    "model:",
    "  path: models/tiny",
    "```",
    "",
    "The path is relative to the YAML file (a URL works too). In VS Code you can instead map it to a",
    "glob in `settings.json`: `\"yaml.schemas\": {\"./rallyrl-config.schema.json\": \"configs/*.yaml\"}`. The",
    "schema holds what a single key can be; checks across keys (e.g. `reward.url` with `reward.fn`) and",
    "the batch plan are made by `rallyrl check CONFIG --nproc N`. The loader stays the authority: the",
    "schema is generated from the same dataclasses (a test keeps the two in agreement).",
    "",
]


def config_markdown() -> str:
    lines = list(_INTRO)
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        lines += [f"## `{section.name}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = _type_name(hints[f.name]).replace("|", "\\|")
            lines.append(
                f"| `{section.name}.{f.name}` | {tp} | `{_default_repr(f)}` | {f.metadata.get('doc', '')} |"
            )
        lines.append("")
        if cls is ModelConfig:
            lines += _sub_table("`model.lora`:", LoraConfig, "model.lora.")
        if cls is GenerationConfig:
            lines += _sub_table("`generation.vllm`:", VLLMConfig, "generation.vllm.")
        if cls is RewardConfig:
            lines += _sub_table("Each entry of `reward.fns`:", RewardFnSpec, "")
            lines += _sub_table("`reward.overlong_buffer` (when set):", OverlongBufferConfig, "reward.overlong_buffer.")
    return "\n".join(lines + _peers_section())


def _peers_section() -> list[str]:
    """The peers' option names (``peers.PEER_OPTIONS``, the table the loader's "did you mean" reads)."""
    lines = [
        "## Coming from TRL / OpenRLHF / veRL",
        "",
        "A peer's option name in a rallyrl config is an error that names the rallyrl key and what differs,",
        "e.g. `unknown config key 'num_generations' (did you mean 'rollout.samples_per_prompt'? ...)`, at the",
        "top level or inside any section. The names below are the loader's table (`rallyrl/config/peers.py`).",
        "Names rallyrl shares with a peer (`gamma`, `lam`, `vf_coef`, `temperature`, `top_p`, `seed`,",
        "`weight_decay`, `init_kl_coef`, ...) are suggested in their section when given in another one.",
        "docs/algorithms.md compares the estimators, KL placements and loss aggregations themselves.",
        "",
        "| their option | whose | rallyrl key | what differs |",
        "|---|---|---|---|",
    ]
    for p in PEER_OPTIONS:
        note = p.note.replace("|", "\\|") or "—"
        lines.append(f"| `{p.name}` | {p.who} | `{p.key}` | {note} |")
    return lines + [""]

