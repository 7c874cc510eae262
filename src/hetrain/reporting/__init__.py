"""After a run: its metrics.jsonl read back (runlog.py) and drawn (plots.py) by `hetrain report`."""
