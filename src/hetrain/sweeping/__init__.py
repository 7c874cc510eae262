"""`hetrain sweep`: many hyperparameter trials at once over mixed devices, on Optuna.

  objective.py  the user's file (objective, or space, memory, train) and what a trial is handed
  main_form.py  a stock Optuna script: its __main__ run, create_study and Study.optimize taken over
  session.py    hetrain.sweep: the running trial's device and speed, for Optuna's objective(trial)
  study.py      the storage, the pruner spec (--pruner median:startup=5), what counts toward --trials
  placement.py  PURE: which queued trial a free device takes, from the planner's memory model
  groups.py     PURE: which group of devices holds a trial too big for one, and its sharding
  asking.py     Optuna's ask in either form: parameters and need before placement
  trial_run.py  one trial run where its device is, its outcome and measured peak
  worker.py     one device's worker process
  group_job.py  a group trial as a torchrun job; group_rank.py: one of its ranks
  runner.py     the study (SQLite through Optuna's RDB storage, resumed after a crash), the flock
  scheduler.py  trials placed on devices and groups, outcomes told to Optuna, a dead worker replaced
  summary.py    the table: trials per device, busy time, utilisation, the best trial
"""
