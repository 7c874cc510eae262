"""A hetrain process's exit without the interpreter's last full garbage collection.

At exit CPython collects every object still alive. After `import torch` (and the torch._dynamo
that torch.optim's first optimizer imports) that heap is large: a process that imports torch,
steps an AdamW and imports hetrain's runtime lasted 2.69-2.76 s with that collection and
2.23-2.28 s without (an AMX Xeon, 3 runs alternated). It happens on the `hetrain` launcher and on
each worker, after the job's own work was done and saved. `gc.freeze()` moves the live objects to the
permanent generation, which that collection skips; the memory goes back to the OS with the
process anyway.

Registered before the handlers that matter (the Engine's exit handler is registered after it),
it runs after them: atexit runs handlers last-in first-out. What it gives up is the __del__ of an
object left in a reference cycle at exit, which Python does not promise to run at exit either
(the data model's note on object.__del__). hetrain closes what must be closed (checkpoints,
metrics files, the checkpoint lock, the process group) explicitly, in close() or its own exit
handler, before this runs.
"""

from __future__ import annotations

import atexit
import functools
import gc


@functools.cache
def skip_final_collection() -> None:
    """Once per process: at exit, freeze the heap so the interpreter's final collection skips it."""
    atexit.register(gc.freeze)
