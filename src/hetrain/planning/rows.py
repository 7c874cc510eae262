"""What every layout's ranking row is made of (pure): the row itself, the layout families in the
ranking's order, the TP traffic constant and the seconds formatter. A leaf, so that ranking.py
(which ranks the rows), chooser.py (which picks one), memory.py's sharding choice and
layouts/tensor/split.py (which builds the TP-by-speed row) import it rather than each other."""

from __future__ import annotations

from dataclasses import dataclass

# Bytes all-reduced per sample under Megatron tensor parallelism, as a fraction of the activation
# bytes kept per sample: per layer 4 all-reduces of s·h bf16 values (2 forward, 2 backward) = 8·s·h
# bytes against ≈ 34·s·h saved (Korthikanti et al. 2022, without the attention scores).
TP_COMM_PER_ACTIVATION = 8 / 34
ORDER = ("DP", "DP + ZeRO-1", "DP + capacity", "FSDP2", "capacity-full", "PP", "DP×PP", "TP", "TP by speed")   # layouts/tensor/split.py
FAMILIES = {"none": "DP", "zero1": "DP + ZeRO-1", "capacity": "DP + capacity", "fsdp": "FSDP2", "capacity-full": "capacity-full"}


@dataclass(frozen=True, kw_only=True)
class LayoutRow:
    name: str                              # 'DP + ZeRO-1', 'PP 3 stages', 'DP×PP 2×2', 'TP 4'
    family: str                            # one of ranking.ORDER
    fits: bool
    samples_per_s: float                   # 0 when it does not fit
    memory: tuple[float | None, ...]       # peak bytes per device (None: not known / unused)
    comm_bytes: float                      # bytes each device moves per step (sent + received)
    comm_s: float                          # communication seconds added to the step (not overlapped)
    detail: str                            # how it runs, or why it does not fit
    run: str                               # how to ask the runtime for it
    recompute: tuple[str, ...] = ()        # devices that checkpoint activations (compute ×4/3)
    savers: tuple[str, ...] = ()           # per device, the memory savers it uses ('ckpt 12/32, optim on host')
    stages: int | None = None              # a pipeline row's stages per replica
    spec: dict | None = None               # what runs it: layout_spec.to_spec of its layout object

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


def seconds(s: float) -> str:
    """'1.11 ms', '13.3 s': for people."""
    return f"{s:,.0f} s" if s >= 100 else f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"
