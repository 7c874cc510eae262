"""TRL's trainers on hetrain's Trainer: the wrapper and its checks (trainers), the per-micro-batch
metrics kept on their rank and agreed when logged (metrics)."""
