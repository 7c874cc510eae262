"""The runtime verbs: init() / prepare(), then backward(), step() and autocast() in the user's loop.

One Engine per process. It coordinates; the work is elsewhere:
  job.py        the job record: what this rank knows and holds
  setup.py      prepare(), as one ordered list of small functions
  runtime/loop/stepping.py   a step: micro-batches, weighted backward, agreement, optimizer step, rebalancing
  runtime/devices/hooks.py      what the device adds (clock; on emulated devices throttle, memory meter, faults)
  runtime/loop/summary.py    the figures at the end
"""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Callable

import torch

from ..errors import UsageError
from ..hardware.cluster import parse_cluster
from ..planning.plan import Plan
from ..process_exit import skip_final_collection
from .config import LAUNCH_ENV, Config, check_keywords
from .ranks.dist import DistContext, cuda_asked_for, env_rank, init_distributed, leave_after_error, shutdown
from ..emulation.islands import join_nodes
from ..emulation.device import EmulatedDevice, agree_host_facts, become_emulated_device
from .resilience.preempt import Preemption
from .resilience.worker_errors import install_excepthook
from .devices.faults import ENV as FAULTS_ENV
from .devices.faults import FaultInjector, parse_faults
from ..emulation.hooks import make_hooks
from ..emulation.link import check_link_request
from .facts import EngineFacts
from .job import Context, Job
from .ranks.log import RankLog
from .devices.precision_policy import PrecisionPolicy
from .user_objects import default_forward
from .resilience import resume as persist
from .setup import prepare_job
from .measure.joint import read_plan_file
from .loop.stepping import StepLoop
from .loop.steps import Step, Steps
from .loop.summary import RunStats, summarize


class Engine(EngineFacts):
    """What `hetrain.init()` returns. All ranks call the same methods in the same order."""

    def __init__(self, config: Config, *, plan: Plan | None = None):
        # First: from here on an explained error is one line (the launch file, the spec, RANK...).
        install_excepthook(*env_rank(), lambda: getattr(self, "job", None))
        config = config.with_launch_file()
        cluster = parse_cluster(config.emulation.cluster) if config.emulation.cluster else None
        if cluster is not None:
            become_emulated_device()   # one CPU thread, throttled from there; glibc keeps freed memory
        use_cuda = rank_device_type(config) == "cuda"
        ctx: DistContext = init_distributed(timeout_s=config.timeout_s, use_cuda=use_cuda)
        install_excepthook(ctx.rank, ctx.world_size, lambda: getattr(self, "job", None))
        log = RankLog(rank=ctx.rank, world_size=ctx.world_size, verbose=config.reporting.verbose,
                      details=config.reporting.details)
        # Every node's devices, gathered (collective): --emulate names this node's own devices.
        ctx, config, nodes, cluster = join_nodes(ctx, config, log)
        emulated = EmulatedDevice(cluster[ctx.rank], sample_s=config.emulation.sample_s,
                                  micro_s=config.emulation.micro_s) if cluster is not None else None
        faults = FaultInjector(parse_faults(config.emulation.faults or os.environ.get(FAULTS_ENV)),
                               rank=ctx.rank, attempt=ctx.restart)
        if faults and emulated is None:
            raise UsageError("fault injection needs emulated devices", "add --emulate SPEC (or emulate=...)")
        # How fast this CPU computes bf16/fp16 decides what an emulated device computes in (collective).
        host = agree_host_facts(rank=ctx.rank, world_size=ctx.world_size) if cluster is not None else None
        # This rank's precision; prepare() agrees it across ranks (bad input raises there, on all).
        precision = PrecisionPolicy.local(config.precision, device=ctx.device, given=emulated, host=host,
                                          allow_fallback=config.allow_fallback)
        self.job = Job(Context(config=config, dist=ctx, log=log, hooks=make_hooks(ctx.device, emulated, faults),
                               precision=precision, faults=faults, host=host,
                               preemption=Preemption(grace_s=config.checkpoints.preempt_grace_s), nodes=nodes))
        check_link_request(self.job)      # Emulation.link_gbs on real GPUs: refused, on every rank alike
        self.job.preemption.install()     # SIGTERM/SIGINT: stop at the next step boundary, saved
        if host is not None and LAUNCH_ENV not in os.environ:   # `hetrain run` printed it already
            log.detail(f"host CPU: {host.describe()}; {host.precision_meaning()} [{host.source}]")
            if host.note:
                log.warn_job(host.note)
        self._given_plan = plan
        self._loop = StepLoop(self.job)
        self._stats = RunStats(ctx.world_size)
        self._loop.on_step = self._stats.add
        self._prepared = False
        self._prepared_at = 0                  # steps done when prepare() returned (resumed ones included)
        self._closed = False
        torch.manual_seed(config.seed)
        skip_final_collection()             # first: it then runs after _at_exit (atexit is LIFO)
        atexit.register(self._at_exit)

    # -- facts (what scripts, integrations and tests read; the job record holds the rest) ------
    config = property(lambda self: self.job.config)
    ctx = property(lambda self: self.job.ctx)
    log = property(lambda self: self.job.log)
    plan = property(lambda self: self.job.plan)
    emulated = property(lambda self: getattr(self.job.hooks, "emulated", None))   # the emulated device, if any
    rank = property(lambda self: self.job.rank)
    world_size = property(lambda self: self.job.world_size)
    device = property(lambda self: self.job.device)
    is_main = property(lambda self: self.job.ctx.is_main)
    steps_done = property(lambda self: self.job.steps_done)
    total_steps = property(lambda self: self.job.total_steps)
    ooms = property(lambda self: self.job.ooms)
    redone_steps = property(lambda self: self.job.redone_steps)
    rebalances = property(lambda self: self.job.rebalances)
    current_micro_batch = property(lambda self: self.job.micro_batch)

    def print(self, message: str) -> None:
        """Print once, from rank 0."""
        self.job.log.info(message)

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                collate_fn: Callable | None = None, forward: Callable = default_forward, parallel="auto",
                loss_fn: Callable | None = None):
        """Choose the layout, plan the split, wrap the model, resume if a checkpoint exists, and
        return (model, optimizer, steps). The order is setup.prepare_job's.

        `parallel`: hetrain.DataParallel(...), TensorParallel(...), Pipeline(...) (layout_spec.py),
        the shorthands 'auto' | 'dp' | 'pp' | 'dp-pp' | 'tp', or a Plan (runtime/layouts/choose.py).
        `loss_fn(output, targets)`: the mean loss, for ht.loss(mb); pipelines need it (their last
        stage computes the loss). `forward(model, batch)` is how hetrain calls the model when it
        measures it before training (default: model(x) for (x, y) batches).
        """
        if self._prepared:
            raise UsageError("prepare() was already called", "call prepare() once per hetrain.init()")
        self._prepared = True
        prepare_job(self.job, model, optimizer, dataset, collate_fn=collate_fn, forward=forward,
                    given_plan=self._given_plan, parallel=parallel, loss_fn=loss_fn)
        self._prepared_at = self.job.steps_done
        return self.job.model, self.job.optimizer, Steps(self._loop)

    def register_state(self, name: str, obj) -> None:
        """Checkpoint `obj` (anything with state_dict/load_state_dict) with the job, and restore
        it on resume. An LR scheduler: build it on the optimizer prepare() returned (sharding may
        have replaced yours) and register it right after prepare(); a resumed job restores its
        state here, at once. Objects that do not hold the optimizer may be registered before
        prepare() too. Every rank registers the same names, before the first step."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UsageError(f"register_state({name!r}): {type(obj).__name__} has no state_dict/load_state_dict",
                             "register an object with both (an LR scheduler, a torch.nn.Module, ...)")
        if name in self.job.extra_state:
            raise UsageError(f"register_state({name!r}) twice", "give each registered object its own name")
        if self._prepared and self.job.steps_done != self._prepared_at:   # a resumed state would be stale by now
            raise UsageError(f"register_state({name!r}) after training started",
                             "register state right after ht.prepare(), before the first step")
        persist.register(self.job, name, obj)

    # -- the verbs ----------------------------------------------------------------------------
    def autocast(self):
        """Autocast to this rank's compute precision (runtime/devices/precision_policy.py; a no-op for fp32)."""
        return self.job.precision.autocast(self.device.type)

    def loss(self, mb):
        """This micro-batch's mean loss, loss_fn(model(inputs), targets) as the layout runs it (under
        a pipeline: recorded, computed by the schedule). Pass it to ht.backward()."""
        return self.job.layout.loss(self.job, mb)

    def backward(self, loss: torch.Tensor, *, tokens: int | float | torch.Tensor | None = None) -> None:
        """Backpropagate one micro-batch's mean loss, weighted so the step's gradient is the
        big-batch gradient. With loss_weighting='tokens', pass the number of tokens the loss
        averaged over."""
        self._loop.backward(loss, tokens)

    def step(self, *, optimizer_step: bool = True) -> Step:
        """Finish the step: optimizer step (or the skip every rank agreed on), then rebalancing
        and checkpoints when due. Returns the step, with its global loss. optimizer_step=False
        (the same on every rank): the step's gradient stays, added to by the next (accumulation)."""
        return self._loop.finish(optimizer_step=optimizer_step)

    # -- the end ------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Run figures (same on every rank); rank 0 prints them with every rank side by side.
        A collective: every rank calls it."""
        return summarize(self.job, self._stats)

    def close(self) -> None:
        """Leave the process group cleanly (a collective: every rank calls it)."""
        if self._closed:
            return
        self._loop.at_boundary()   # a checkpoint due after the last step taken (the loop may have broken off)
        self.job.log.flush()
        self._closed = True
        self._release()
        shutdown(self.ctx)

    def _at_exit(self) -> None:
        """An interpreter exit without close() (an error the script caught, say): free the DDP
        wrapper before the process group goes, which is what stops gloo aborting at exit (SIGABRT:
        ranks/dist.py's docstring). No barrier: peers may be gone; NCCL's communicators are aborted."""
        if self._closed:
            return
        self._closed = True
        self.job.log.flush_alone()
        self._release()
        gc.collect()
        leave_after_error(self.ctx)

    def _release(self) -> None:
        self.job.preemption.uninstall()
        if self.job.recorder is not None:      # metrics.jsonl and TensorBoard's files, complete
            self.job.recorder.close()
        gc.unfreeze()
        if self.job.checkpointer is not None:   # checkpoint_dir's lock: another job may use it now
            self.job.checkpointer.close()
        if self.job.model is not None:
            self.job.model.release_wrapper()
        self.job.sync = self.job.guard = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:   # peers may be gone: no barrier, just release what we hold
            self._at_exit()


def rank_device_type(config: Config) -> str:
    """The device type ('cuda' or 'cpu') the job's ranks run on, known before they join (`config`
    with the launch file applied): the CPU for emulated devices (CPU processes playing them), else
    CUDA where a GPU is visible or asked for (CUDA_VISIBLE_DEVICES), else the CPU."""
    if config.emulation.cluster:
        return "cpu"
    return "cuda" if torch.cuda.is_available() or cuda_asked_for() else "cpu"


def init(*, plan: Plan | str | None = None, **config) -> Engine:
    """Join the job and read its configuration. Keyword arguments: see hetrain.runtime.config.Config;
    `plan` (a Plan, or the path of one saved as JSON) fixes every rank's share and micro-batch for
    the job, and its layout (prepare(parallel=plan) is the other way in, for one prepare)."""
    install_excepthook(*env_rank(), lambda: None)   # before the config is checked: bad input is one line
    check_keywords(config)       # an unknown keyword: one error naming where it lives, or the close names
    if "global_batch" not in config:
        raise UsageError("hetrain.init: no global_batch given", "pass global_batch=N, the samples per optimizer "
                         "step over all devices")
    if isinstance(plan, str):
        plan = read_plan_file(plan)
    elif plan is not None and not isinstance(plan, Plan):
        raise UsageError(f"hetrain.init: plan={plan!r} is neither a Plan nor a path",
                         "pass the path of a file `hetrain plan --out` wrote, or a Plan")
    return Engine(Config(**config), plan=plan)
