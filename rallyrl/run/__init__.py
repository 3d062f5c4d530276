"""The run directory and everything rallyrl writes there (DESIGN.md, "Run directory").

- ``lock``: one run, one writer (``RunDirLock``, ``holding_run_dir_locks``, ``releases_run_dir_lock``);
- ``rundir``: the folder's lifecycle (``RunDir``: may a run start here, resume point, manifest of
  rallyrl's own files, log truncation after a resume); ``resume``: which start it is (fresh, over an
  earlier run, or a resume from which checkpoint) and the refusals, each naming a command that works;
- ``logs``: the JSONL logs, read and written in this one place (``metrics.jsonl`` as a tracker,
  ``rollouts.jsonl``, evaluation samples, ``config_history.jsonl``; ``read_jsonl``);
- ``console``: what the run says while it runs (``RunLog``); ``result``: what ``train()`` returns (``TrainResult``);
- ``stage``: stage 7 of the loop, checkpoints and ``final/``; ``checkpoint``: the checkpoint files
  (atomic save, verify, resume choice, load); ``card``: ``final/README.md``.

The experiment trackers (TensorBoard, W&B, MLflow, Trackio) are ``rallyrl.trackers``. Nothing is
imported here: ``rallyrl.run.lock`` and ``rallyrl.run.rundir`` stay free of torch (the CLI refuses a busy
run directory before it imports anything heavy), while ``run.checkpoint`` needs it.
"""
