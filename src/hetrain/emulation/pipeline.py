"""An emulated device as a pipeline stage asks it (runtime/layouts/pipeline/stage_hooks.py): made by
its hooks (hooks.EmulatedHooks.stage_hooks), so the pipeline's runtime never learns it is one.

Speed. A stage's `forward_one_chunk` and `backward_one_chunk` (one micro-batch's piece, with no
communication inside) are timed on the host's wall clock and followed by a sleep of c·(1/s − 1)
(`Throttle.pay`): a piece that waits for a core, or computes beside others, stretches the stage by
the same factor, as sharing.py plays it out. Wall time, not CPU time: scaling wall time keeps the
devices' speed ratio even when a shared CPU slows every process. A piece's clock (clock.EmulatedClock
on the wall base) adds what the throttle charged and has not slept yet.

The controlled clock (Emulation.sample_s). A piece lasts its share of the micro-batch's clocked
forward+backward (forward 1/3, backward 2/3; the loss, outside the blocks' profile, its own time),
whatever it took (`Throttle.pay_clocked`): the micro-batch's parts' share of the clock (the job's
profile, put on the clock by `as_run`: PipelineProfile.on_clock), of the per-sample part and of the
fixed part a micro-batch pays whatever its size (Emulation.micro_s, as a data-parallel micro-batch
pays it: a device's per-layer launches do not vanish when its layers are cut into stages).

Memory. The stage counts the bytes its activations hold between forward and backward (a hook per
saved tensor), and its meter's model state plus those bytes count toward the device's peak; past
its cap they are the error a real device's allocator would have raised during the forward.

The host. Emulated stages are processes of one host and share its cores: the pipeline probe
measures how (`probe_host`, below), the profile keeps the figures (PipelineProfile.host), and the
step is played out on the cores (sharing.stretched_step) by the ranking (SharedHost.pipeline) and
by the job's own prediction (`predicted_step`). On the controlled clock a piece lasts its clocked
length, its waits for a core inside its sleep: no sharing to pay for.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..hardware.units import format_bytes
from ..runtime.devices import clock as clocks

if TYPE_CHECKING:           # torch: loaded where a stage is built, not where a step is played out (sharing.py)
    from .device import Throttle


class EmulatedStage:
    """An emulated device's throttle and meter, as its pipeline stages use them: every question of
    runtime/layouts/pipeline/stage_hooks.StageHooks, answered for the emulated device (the
    runtime's layouts sit above the emulator: the same methods, not a subclass)."""

    meter = None

    counts_bytes = True
    blocks_on_host = True     # every block timed at speed 1 on this CPU (layouts/pipeline/block_cache.py)

    def __init__(self, throttle: Throttle, meter=None, *, sample_s: float | None = None):
        self.throttle, self.meter, self.sample_s = throttle, meter, sample_s

    def clock(self, device):
        from .clock import EmulatedClock

        return EmulatedClock(device, self.throttle, wall=True)

    def for_probe(self) -> EmulatedStage:
        """A fresh throttle of the device's speed (synchronous, off any clock) and no meter: the
        probe's one-stage runs are throttled as the runtime throttles a stage's pieces, and count
        their saved bytes as it does."""
        from .device import Throttle

        return EmulatedStage(Throttle(self.throttle.speed))

    def piece_done(self, length_s: float | None, cpu_s: float, wall_s: float) -> None:
        if length_s is not None:
            self.throttle.pay_clocked(length_s, cpu_s, wall_s)
        else:
            self.throttle.pay(wall_s)

    def micro_batch_s(self, rows: int, stage_s: float, whole_s: float) -> float | None:
        """On the controlled clock, at speed 1: the stage's share of the per-sample part and of the
        fixed part (the module docstring). None off the clock: the pieces keep the CPU's time."""
        if self.throttle.sample_s is None:
            return None
        return rows * stage_s + self.throttle.micro_s * stage_s / whole_s

    def hold(self, activation_bytes: int, micro_batches: int) -> None:
        # Counted here, not by the meter's own forward hooks: its peak (the summary's peak_bytes)
        # must include the stage's activations, or a stage reports its state alone.
        meter = self.meter
        if meter is None:
            return
        meter.peak = max(meter.peak, meter.fixed + activation_bytes)
        if meter.cap is not None and meter.fixed + activation_bytes > meter.cap:
            import torch

            raise torch.OutOfMemoryError(
                f"emulated {format_bytes(meter.cap)}: {format_bytes(meter.fixed)} of model state + "
                f"{format_bytes(activation_bytes)} of activations for {micro_batches} micro-batch(es) in flight")

    def as_run(self, profile):
        """On the controlled clock, the blocks put on it (PipelineProfile.on_clock); else as measured."""
        if self.sample_s is None or profile is None:
            return profile
        return profile.on_clock(self.sample_s)

    def probe_host(self, time_piece, x, *, device, overhead_s: float) -> dict:
        """The schedule's own CPU a piece (outside the throttled pieces: no throttle stretches it),
        and with 2+ ranks: the contention (a block's piece run by every rank at once against
        alone, unthrottled, less the processor sharing of more ranks than cores); a message's
        one-way time between two ranks while the others wait, and while they keep every core busy
        (a process that has just computed is woken later on a full host: 0.6-2.7 ms against
        0.1-1.2 in the 4-rank probes on a 2-core AMD EPYC VM, gloo)."""
        import torch.distributed as dist

        world = dist.get_world_size()
        out = {"piece_overhead_s": overhead_s}
        if world > 1:
            shared = _time_sharing(time_piece, x, device=device)
            cores = shared["cores"]
            out.update(contention=min(2.0, max(1.0, shared["ratio"] / max(1.0, world / cores))),
                       contention_at=int(min(world, cores)), message_s=shared["message_s"],
                       busy_message_s=shared["busy_message_s"])
        return out

    def host_said(self, host: dict) -> str:
        if "contention" not in host:
            return ""
        return (f"; emulated stages on this host's cores: contention x{host['contention']:.2f} with "
                f"{host['contention_at']} at once, a message {host['message_s'] * 1e3:.2f} ms "
                f"({host['busy_message_s'] * 1e3:.2f} ms with every core busy), the schedule's own "
                f"{host.get('piece_overhead_s', 0.0) * 1e3:.2f} ms of CPU a piece")

    def shared_host(self):
        """The host's cores, shared by the stages (none on the controlled clock)."""
        from ..hardware.host import usable_cores
        from .sharing import SharedHost

        return SharedHost(cores=usable_cores()) if self.sample_s is None else None

    def predicted_step(self, splits, profile, *, step_s: float, global_batch: int) -> dict:
        """The step played out on this host's cores (sharing.stretched_step, as the layout ranking
        costs it) with the contention and message times the pipeline probe measured. The replicas'
        gradient all-reduce and the optimizer are not in it (`hetrain plan`'s ranking has them)."""
        from ..hardware.host import usable_cores
        from .sharing import sharing, stretched_step

        if self.sample_s is not None:
            return {}
        cores = usable_cores()
        shared, stretch = stretched_step(splits, cores=cores, **sharing(profile))
        if not shared > step_s:
            return {}
        return dict(samples_per_s=global_batch / shared, step_s=shared, alone_step_s=step_s,
                    host_cores=cores, stage_stretch=max(stretch))   # the plan keeps numbers only

    def predicted_said(self, predicted: dict, *, stages: int, global_batch: int) -> str | None:
        if "stage_stretch" not in predicted:
            return None
        return (f"predicted {predicted['samples_per_s']:.1f} samples/s: the {stages} emulated stages share "
                f"{predicted['host_cores']:g} CPU cores, so their pieces last up to x{predicted['stage_stretch']:.2f} "
                f"longer than alone ({global_batch / predicted['alone_step_s']:.1f} samples/s without that)")


def _time_sharing(time_piece, x, *, device) -> dict:
    """How emulated stages share this host's cores (a collective of every rank): each rank's
    stage piece run alone (in turn) and with every rank running it at once, unthrottled (so all
    compute together: their ratio, less the processor sharing, is the contention the pipeline
    model plays out, sharing.py); and a message's one-way time between two ranks (a round trip of
    one micro-batch's activations, halved) while the others wait, and while they keep every core
    busy: a stage blocked in a receive is woken at once on a free core, after the scheduler's delay
    on a full one (0.6-2.7 ms against 0.1-1.2 in the 4-rank probes run on a 2-core AMD EPYC, gloo)."""
    import torch.distributed as dist

    from ..hardware.host import usable_cores
    from ..runtime.ranks import agree

    rank, world = dist.get_rank(), dist.get_world_size()
    big = x[:max(1, int(x.shape[0]))]
    alone = 0.0
    for turn in range(world):
        if turn == rank:
            alone = time_piece()
        dist.barrier()
    together = time_piece()
    dist.barrier()
    cores = usable_cores()
    table = agree.exchange({"alone": alone, "ratio": together / alone if alone > 0 else 1.0},
                           rank=rank, world_size=world, device=device)
    gap = statistics.median(table.column("alone"))     # the pair computes a piece's worth between messages
    # Each figure the lesser of two medians, the sets quiet and busy in turn: a phase of the host
    # slows every trip of a set it meets, and rarely both sets (five plans of DP×PP 2×2 on a 2-core
    # EPYC, one set each, read the quiet message 0.15-3.0 ms, once above the busy figure, and
    # moved the row 109-127 samples/s); a phase only adds time, so the lesser is kept.
    quiet = busy = float("inf")
    for _ in range(2):
        quiet = min(quiet, _time_messages(big, busy_threads=0, gap_s=gap))
        if world > 2:
            busy = min(busy, _time_messages(big, busy_threads=-(-int(cores) // (world - 2)), gap_s=gap))
    if world <= 2:          # with two ranks no third keeps the cores busy: the quiet figure stands for both
        busy = quiet
    return {"ratio": statistics.median(table.column("ratio")), "cores": cores, "message_s": quiet,
            "busy_message_s": busy}


def _time_messages(x, *, busy_threads: int, gap_s: float, trips: int = 24) -> float:
    """Median one-way seconds of `x` between ranks 0 and 1 (the same on every rank), each of the
    pair computing `gap_s` before each round trip, as a stage computes its piece before it sends
    and then waits for the next input (the scheduler wakes a process that has just computed later
    than one that has slept: 2.0 ms one way against 0.08 here, with every core busy); every other
    rank runs `busy_threads` threads of matrix products meanwhile (0: it waits)."""
    import threading

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    payload = x.detach().float().contiguous().cpu().clone()
    times = []
    stop = threading.Event()
    spinners = []
    if rank > 1 and busy_threads:
        a = torch.randn(192, 192)

        def spin():
            while not stop.is_set():
                a @ a
        spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy_threads)]
        for t in spinners:
            t.start()
    done = dist.barrier(async_op=True) if rank > 1 else None     # the pair joins it when done
    if rank <= 1:
        a = torch.randn(192, 192)
        for _ in range(trips + 2):
            t1 = clocks.host()
            while clocks.host() - t1 < gap_s:
                a @ a
            t0 = clocks.host()
            if rank == 0:
                dist.send(payload, 1)
                dist.recv(payload, 1)
            else:
                dist.recv(payload, 0)
                dist.send(payload, 0)
            times.append((clocks.host() - t0) / 2)
        dist.barrier()
    else:
        done.wait()
        stop.set()
        for t in spinners:
            t.join()
    box = [statistics.median(times[2:]) if times else 0.0]
    dist.broadcast_object_list(box, src=0)
    return float(box[0])
