"""A Fabric that asks for more devices than `hetrain run` started, refused, then Lightning's
language_model example (fabric_language_model.py, unchanged) in the same process: the refusal
names the fix and leaves no job behind, since the example's own Fabric joins after it. Each rank
writes the refusal and the excepthook it would have reached to OUT_DIR/refused-rank{r}.json.

    hetrain run --emulate a100-80g,rtx3090 fabric_refused_then_language_model.py OUT_DIR
"""

import json
import os
import runpy
import sys
from pathlib import Path

from hetrain.errors import UsageError
from hetrain.integrations.lightning import Fabric

try:
    Fabric(accelerator="cpu", devices=4)
except UsageError as e:
    refused = {"kind": type(e).__name__, "what": e.what, "fix": e.fix, "exit_code": e.exit_code,
               "hook": sys.excepthook.__module__}     # where it goes uncaught (Lightning's import kept hetrain's)
else:
    raise SystemExit("Fabric(devices=4) was not refused")
with open(f"{sys.argv[1]}/refused-rank{os.environ['RANK']}.json", "w") as f:
    json.dump(refused, f)
runpy.run_path(str(Path(__file__).with_name("fabric_language_model.py")), run_name="__main__")
