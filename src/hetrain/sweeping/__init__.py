"""`hetrain sweep`: many hyperparameter trials at once over mixed devices, on Optuna.

  objective.py  the user's file (space, memory, train) and what a trial is handed (TrialContext)
  placement.py  PURE: which queued trial a free device takes, from the planner's memory model
  runner.py     the study (SQLite through Optuna's RDB storage, resumed after a crash), the flock
  scheduler.py  Optuna's ask/tell, trials handed to the devices' workers, a dead worker replaced
  worker.py     one device's worker process
  summary.py    the table: trials per device, busy time, utilisation, the best trial
"""
