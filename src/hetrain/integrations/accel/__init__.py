"""Accelerate scripts on hetrain: the Accelerator's verbs (accelerator), the training loop's
loader, optimizer and scheduler (loop), evaluation loaders and gather_for_metrics (evaluation)."""
