"""One rank of a training run under torchrun that records how ``rallyrl.train`` ended on THIS rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/helpers/train_worker.py CONFIG OUT

(``RALLYRL_TEST_CALLBACKS=module:factory`` passes ``callbacks=factory()`` on every rank;
``RALLYRL_TEST_FULL_LOAD=1`` makes ``model.sharding: fsdp`` load the weights the way it did before loading
straight into shards: whole on every rank, then sharded; ``RALLYRL_TEST_UNREADABLE_WEIGHTS=1`` makes rank 0's
read of the initial weights fail with an I/O error) writes ``OUT/rank<R>.json`` = ``{"rank", "ok", "type", "message", "start", "end"}`` (the exception's type
and message, if ``train`` raised), so a test can check that every rank ended with the same error. The
process then leaves with ``os._exit(0)``: what is checked is the record, not the exit (a daemon thread
still sleeping in an abandoned reward call must not decide it).
"""

import json
import os
import sys
import time
from pathlib import Path


def main(config: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import rallyrl

    rank = int(os.environ.get("RANK", "0"))
    rec = {"rank": rank, "ok": True, "type": None, "message": None, "start": time.time()}
    callbacks = None
    if os.environ.get("RALLYRL_TEST_CALLBACKS"):  # "module:factory", a factory of the callbacks list
        import importlib

        module, attr = os.environ["RALLYRL_TEST_CALLBACKS"].split(":")
        callbacks = getattr(importlib.import_module(module), attr)()
    if os.environ.get("RALLYRL_TEST_FULL_LOAD"):  # the folder "cannot" be read into shards: the usual loading
        import rallyrl.models.loading as loading

        loading.empty_lm = lambda *args: (None, None, "RALLYRL_TEST_FULL_LOAD")
    if os.environ.get("RALLYRL_TEST_UNREADABLE_WEIGHTS") and rank == 0:  # rank 0's read of the weights fails
        from rallyrl.models.weights import InitialWeights

        def unreadable(self, module):
            path = next(iter(self.files.values()))[0]
            raise OSError(5, "Input/output error", str(path))

        InitialWeights.full_state_dict = unreadable
    try:
        rallyrl.train(config, callbacks=callbacks)
    except BaseException as e:  # noqa: BLE001 - recorded for the test, whatever it is
        rec.update(ok=False, type=type(e).__name__, message=str(e))
    rec["end"] = time.time()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rec))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
