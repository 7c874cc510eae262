"""`hetrain bench`: each device alone, an equal split and hetrain's split, measured on the user's
model and devices (runs.py: the configurations as real jobs; worker.py: one job's loop; show.py:
the table and the chart)."""
