"""The fork server's last preload (harness.PRELOAD): its heap, the preloaded libraries' ~550k
objects, moved to Python's permanent generation, so a rank forked from it does not scan them in a
full collection. hetrain collects in full when a job is prepared (setup.freeze_heap) and when a
probe or an out-of-memory redo frees memory: ~0.3 s of CPU each in a rank otherwise. (A job's
close unfreezes them again; the collections before it are the ones this spares.)"""

import gc

gc.freeze()
