"""A Fabric script that asks for more devices than `hetrain run` started: one line, exit 2."""

from hetrain.integrations.lightning import Fabric

fabric = Fabric(accelerator="cpu", devices=4)
raise SystemExit("Fabric(devices=4) was not refused")
