"""`model.prepare`: a hook that builds the model folder on first use, before the folder is checked."""

import pytest

from rallyrl.config import ConfigError, load_config
from rallyrl.inputs import prepare_inputs
from rallyrl.models import ModelLoadError
from tests.helpers.runs import base_config

HOOK = '''
from pathlib import Path
CALLS = []

def build(path):
    CALLS.append(path)
    if not (Path(path) / "config.json").is_file():
        from rallyrl.testing import build_tiny_gpt2
        build_tiny_gpt2(path)

def broken(path):
    raise RuntimeError("no GGUF here")
'''


def config(model_dir, run_dir, prepare):
    cfg = base_config(model_dir, run_dir)
    cfg["model"]["prepare"] = prepare
    return load_config(cfg)


@pytest.fixture
def hook_file(tmp_path):
    path = tmp_path / "hook.py"
    path.write_text(HOOK)
    return path


def test_the_hook_builds_the_folder_before_it_is_checked_and_is_called_each_time(tmp_path, hook_file):
    model_dir = tmp_path / "models" / "tiny"
    cfg = config(model_dir, tmp_path / "run", f"{hook_file}:build")
    inp = prepare_inputs(cfg, world_size=1)
    assert (model_dir / "config.json").is_file() and len(inp.train_set) == 10
    prepare_inputs(cfg, world_size=1)  # second time: the hook runs again and finds the folder there
    from rallyrl.reward.loading import load_object

    assert load_object(f"{hook_file}:CALLS") == [str(model_dir), str(model_dir)]


def test_a_failing_hook_is_a_model_load_error_naming_the_hook(tmp_path, hook_file):
    cfg = config(tmp_path / "m", tmp_path / "run", f"{hook_file}:broken")
    with pytest.raises(ModelLoadError, match=r"model.prepare: .*hook.py:broken\('.*m'\) failed: RuntimeError: no GGUF here"):
        prepare_inputs(cfg, world_size=1)


def test_hook_import_errors_and_a_missing_model_path(tmp_path, hook_file):
    from rallyrl.reward.loading import ImportPathError

    cfg = config(tmp_path / "m", tmp_path / "run", f"{hook_file}:nope")
    with pytest.raises(ImportPathError, match="model.prepare: .* has no attribute 'nope'"):
        prepare_inputs(cfg, world_size=1)
    cfg = config("", tmp_path / "run", f"{hook_file}:build")
    with pytest.raises(ConfigError, match="model.path is required"):
        prepare_inputs(cfg, world_size=1)
