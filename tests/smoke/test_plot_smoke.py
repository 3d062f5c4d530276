"""A real 2-iteration run on the tiny GPT-2, then `rallyrl plot` on its run directory."""

import pytest

import rallyrl
from rallyrl.cli import main as cli_main
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke

matplotlib_image = pytest.importorskip("matplotlib.image")


def test_plot_a_real_run(tiny_model, tmp_path, capsys):
    run_dir = tmp_path / "tiny_run"
    cfg = base_config(tiny_model, run_dir, data={"eval_prompts": ["the", "a dog"]})

    def metric_fn(samples, prompts, outputs, **kw):
        return {"length": [len(o) for o in outputs]}

    rallyrl.train(cfg, metric_fn=metric_fn)
    capsys.readouterr()
    out = tmp_path / "plots"
    assert cli_main(["plot", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = ["reward.png", "kl.png", "eval.png", "losses.png", "time.png"]
    assert printed == [str(out / n) for n in names]
    for n in names:
        img = matplotlib_image.imread(out / n)  # decodes: a valid PNG, not just a file
        h, w = img.shape[:2]
        assert h >= 300 and w >= 500, (n, img.shape)
        assert img[..., :3].std() > 0.01, f"{n} is blank"
