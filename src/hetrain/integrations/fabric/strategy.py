"""HetrainStrategy: a Lightning Fabric strategy whose ranks are hetrain's job.

    fabric = Fabric(strategy=HetrainStrategy(global_batch=64))
    fabric.launch()                                  # joins hetrain's job (hetrain.init)
    model, optimizer = fabric.setup(model, optimizer)          # any order: hetrain.prepare runs once
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=32, shuffle=True))   # all three are in
    for epoch in range(2):                           # one pass: one epoch of hetrain's sampler
        for batch in loader:                         # this rank's micro-batches of each global step
            optimizer.zero_grad()                    # inside a step: a no-op (the gradient accumulates)
            fabric.backward(loss_of(model, batch))   # weighted by the micro-batch's size
            optimizer.step()                         # after the rank's last micro-batch: the agreed step
    fabric.strategy.close()

Fabric's own loop is fabric/loop.py's; the step form, `for step in fabric.strategy.steps(): for mb
in step: with mb:`, also redoes a forward that ran out of memory (the loop's docstring says what
each form gives). The setup order and the global batch rule (batch_size is the mean share) are
fabric/data.py's. Here too: the drop-in `Fabric` (Lightning's, with this strategy, joined at
construction) and the checks of Fabric's accelerator, devices and num_nodes against the job the
launcher started.

Why a ParallelStrategy of its own and not a DDPStrategy subclass: everything DDPStrategy adds is
what hetrain does differently. Its launcher spawns processes (hetrain's job is started by `hetrain
run` / torchrun, one process per device); its `_setup_distributed` builds the process group
(hetrain.init joins the job, gathers every node's devices and agrees the host's facts); its
setup_module wraps DDP with equal batches (hetrain.prepare plans uneven shares, wraps DDP or a
sharding with the OOM guard and the comm hook); its backward-sync control would call no_sync on a
module hetrain already runs under no_sync for every micro-batch but the last. So the strategy
implements Fabric's Strategy API on top of the Engine instead of overriding DDP's.

What Fabric gives up under it (each refused with the fix, never silently changed): its launcher
(`fabric run`, spawn), its precision plugins (hetrain picks each device's precision:
HetrainStrategy(precision=...)), its DistributedSampler on the training data (hetrain splits the
global batch; evaluation loaders are split by the plan: fabric/data.py), several models or
optimizers, and pipelines. fabric.clip_gradients clips the step's final gradient, in the step
(fabric/loop.py). Fabric's no_backward_sync warns and does nothing, as for any strategy
without sync control: hetrain already syncs once per step.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric as LightningFabric
from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    TorchElasticEnvironment,
)
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from ...errors import UsageError
from ...runtime.config import Config, integration_layout, make_config
from ...runtime.engine import Engine, init, rank_device_type
from ...runtime.user_objects import default_forward
from ...runtime.ranks.dist import env_rank
from .data import LoaderStep, Pieces, StepLoader, evaluation_loader, global_batch, refuse_sharded, training_data
from .loop import Clipping, PlainLoop, Request

# Set on the DataLoader, which Fabric users already do; two places to say it would be two answers.
FROM_THE_LOADER = ("shuffle", "drop_last")


class HetrainPrecision(Precision):
    """Fabric's precision plugin under HetrainStrategy: every forward through the model Fabric set
    up (and fabric.autocast()) runs in this device's own precision, hetrain's autocast. Loss
    scaling, unscaling and the agreed skip of an overflowed step are inside hetrain's backward and
    step, so the plugin adds nothing else."""

    def __init__(self, strategy: HetrainStrategy):
        super().__init__()
        self.strategy = strategy

    def forward_context(self):
        engine = self.strategy.engine
        return engine.autocast() if engine is not None else nullcontext()


class HetrainStrategy(ParallelStrategy):
    """Fabric's strategy for mixed devices: uneven per-rank shares, the big-batch gradient, one
    agreed step, OOM recovery and rebalancing (hetrain's loop, driven through Fabric's verbs).

    Every keyword is hetrain.init's (hetrain.runtime.config.Config: max_steps, epochs, precision,
    grad_clip, checkpoints, ...; `plan` fixes every rank's share; `sharding` is the
    DataParallel the strategy runs: DataParallel(sharding=...)), but
    `global_batch` may be left out: the training DataLoader's batch_size x devices then
    (fabric/data.py). `forward(model, batch)` is how hetrain calls the model when it measures
    it before training (default: model(**batch) for dicts, model(x) for (x, y)); a model it
    cannot call so is planned from the loop's first steps instead (runtime/measure/model_call.py).
    """

    def __init__(self, *, global_batch: int | None = None, plan=None, forward=default_forward, **config: Any):
        config, self.layout = integration_layout(config)      # sharding=: the DataParallel it runs
        _check_config(global_batch, config)
        super().__init__()
        self.config = config
        self.given_global_batch = global_batch   # None: the DataLoader's batch_size x devices (fabric/data.py)
        self.given_plan = plan
        self.forward = forward
        self.engine: Engine | None = None        # hetrain's job, joined by fabric.launch()
        self.pieces = Pieces(self)               # the model, optimizer and data handed over; hetrain's Steps
        self.plain = PlainLoop(self)             # Fabric's own loop over hetrain's steps
        self.clipping = Clipping(self)           # fabric.clip_gradients, applied in the step
        self.split_next = False                  # the loader being set up asked for Fabric's sampler
        self.evaluating = 0                      # evaluation passes in progress (their batches differ by rank)
        self._num_nodes = 1                      # Fabric(num_nodes=...), set by Fabric's connector

    def job_config(self) -> dict:
        """hetrain.init's keywords. Without global_batch= it is decided at setup_dataloaders (the
        batch_size rule); until then the job holds a stand-in that nothing before prepare() reads."""
        stand_in = self.given_plan.global_batch if self.given_plan is not None else 1
        return {"global_batch": self.given_global_batch or stand_in, **self.config}

    def job_global_batch(self) -> int:
        engine = self.joined()
        return engine.config.global_batch if self.pieces.steps is not None else \
            global_batch(self.given_global_batch, self.pieces.data, engine.world_size)

    @property
    def run_length_given(self) -> bool:
        """max_steps= or epochs= given: the run's length is hetrain's, not the loop's."""
        config = self.joined().config
        return config.max_steps is not None or config.epochs is not None

    def in_step(self) -> bool:
        """Between a step's first micro-batch and its optimizer step (zero_grad waits till then)."""
        steps = self.pieces.steps
        return steps is not None and steps.loop.state is not None

    def steps(self):
        """The step form, for OOM recovery of every micro-batch (fabric/loop.py says what each form
        gives): `for step in fabric.strategy.steps(): for mb in step: with mb: ...`, then
        optimizer.step(). One pass is the whole run (max_steps, or epochs of the dataset)."""
        for step in self.pieces.ready_steps():
            yield LoaderStep(step)

    # -- what Fabric's connector hands over: checked, since hetrain decides these itself -----------
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else HetrainPrecision(self)

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # None while constructing: Fabric's connector then sets the plugin its flags chose.
        if precision is not None and type(precision) is not Precision and not isinstance(precision, HetrainPrecision):
            chosen = getattr(precision, "precision", None)
            raise UsageError(
                f"Fabric's precision {type(precision).__name__}" + (f" ({chosen!r})" if chosen else "")
                + " under HetrainStrategy: hetrain sets each device's precision itself (bf16 where the card has it, "
                "fp16 with one job-wide loss scale elsewhere)",
                "leave Fabric's precision at its default ('32-true') and pass HetrainStrategy(precision='auto' | "
                "'bf16' | 'fp16' | 'fp32'); for a float64 model, call model.double() before fabric.setup")
        self._precision = precision if precision is None or isinstance(precision, HetrainPrecision) \
            else HetrainPrecision(self)

    @property
    def cluster_environment(self):
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env) -> None:
        # torchrun's variables (TorchElastic), or the same ones set by hand / a single process
        # (Lightning's fallback): what hetrain.init joins by. Slurm, MPI, LSF... name ranks in
        # their own variables that hetrain would not see, so every process would train alone.
        if env is not None and type(env) not in (TorchElasticEnvironment, LightningEnvironment):
            raise UsageError(
                f"Fabric's cluster environment {type(env).__name__} under HetrainStrategy: hetrain joins the job "
                "by torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR), which `hetrain run` sets",
                "launch with `hetrain run` (`hetrain run --slurm` under Slurm) and drop the ClusterEnvironment plugin")
        self._cluster_environment = env

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def distributed_sampler_kwargs(self) -> None:
        """None: Fabric adds no DistributedSampler; hetrain samples every rank's uneven share. Fabric
        reads this for a loader set up with use_distributed_sampler=True (its default) only: that
        loader, when it is not the training data, is split here (process_dataloader)."""
        self.split_next = True
        return None

    # -- ranks and device: the job's --------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.engine.rank if self.engine is not None else env_rank()[0]

    @property
    def world_size(self) -> int:
        return self.engine.world_size if self.engine is not None else env_rank()[1]

    @property
    def local_rank(self) -> int:
        return self.engine.ctx.local_rank if self.engine is not None else int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def node_rank(self) -> int:
        if self.engine is not None and self.engine.node_rank is not None:
            return self.engine.node_rank
        return int(os.environ.get("GROUP_RANK", "0"))

    @property
    def root_device(self) -> torch.device:
        return self.joined().device

    def joined(self) -> Engine:
        if self.engine is None:
            raise UsageError("HetrainStrategy has not joined hetrain's job yet",
                             "call fabric.launch() first (under `hetrain run` or torchrun it starts no processes)")
        return self.engine

    def setup_environment(self) -> None:
        """fabric.launch(): join hetrain's job (its process group, every node's devices, the plan's
        inputs) instead of Fabric's own process group."""
        if self.engine is not None:
            return
        self.check_world()
        engine = init(plan=self.given_plan, **self.job_config())                # (collective)
        with ExitStack() as undo:
            undo.push(engine)     # a setting refused below: release the job without a barrier, as on any error
            check_device(self, engine)
            undo.pop_all()
        self.engine = engine
        rank_zero_only.rank = utils_rank_zero_only.rank = engine.rank     # Fabric's rank-zero printing
        super().setup_environment()                                        # the accelerator readies the device

    def check_world(self) -> None:
        check_world(self)

    def ranks_device_type(self) -> str:
        """The device type ('cuda' or 'cpu') the job's ranks run on, known before joining."""
        return rank_device_type(Config(**self.job_config()).with_launch_file())

    # -- setup, in any order: hetrain's prepare() once the model, optimizer and data are in ----------
    def process_dataloader(self, dataloader):
        """The first DataLoader set up is the training data (hetrain's steps); later ones are
        evaluation loaders, split by the plan's shares (fabric/data.py) unless set up with
        use_distributed_sampler=False."""
        split, self.split_next = self.split_next, False
        if self.pieces.data is not None:
            return evaluation_loader(self, dataloader) if split else dataloader
        data = training_data(dataloader)
        self.pieces.take_data(data)
        return StepLoader(self, data)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if len(optimizers) != 1:
            raise UsageError(f"fabric.setup with {len(optimizers)} optimizers under HetrainStrategy",
                             "pass exactly one optimizer: fabric.setup(model, optimizer)")
        self.joined()
        model, optimizer, scheduler = self.pieces.take_both(module, optimizers[0], scheduler)
        return model, [optimizer], scheduler

    def setup_module(self, module):
        self.joined()
        return self.pieces.take_module(module)

    def setup_optimizer(self, optimizer):
        self.joined()
        return self.pieces.take_optimizer(optimizer)

    def module_to_device(self, module) -> None:
        module.to(self.root_device)

    # -- the step: hetrain's verbs behind Fabric's ------------------------------------------------
    def backward(self, tensor, module, *args, tokens=None, **kwargs) -> None:
        """fabric.backward(loss): weighted by this micro-batch's size (or `tokens=`, under
        loss_weighting='tokens'), so the step's gradient is the big-batch gradient."""
        if args or kwargs:
            raise UsageError(f"fabric.backward(loss, ...) with {[*args, *kwargs]}: hetrain runs each micro-batch's "
                             "backward itself, weighted", "call fabric.backward(loss) (tokens=N under "
                             "loss_weighting='tokens')")
        self.joined().backward(tensor, tokens=tokens)

    def optimizer_step(self, optimizer, **kwargs):
        """optimizer.step(): hetrain's step (the agreed optimizer step or skip, rebalancing,
        checkpoints), returning hetrain's Step, whose `loss` is the global batch's. In Fabric's own
        loop, a no-op returning None until this rank's last micro-batch of the step."""
        if kwargs:
            raise UsageError("optimizer.step(closure=...) under HetrainStrategy: a step's micro-batches run once, "
                             "in the loop", "call optimizer.step() after the step's micro-batches")
        if self.plain.active:
            return self.plain.optimizer_step()
        return self.joined().step()

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        """Clips the step's final gradient, in the step (fabric/loop.py); the tensor returned
        holds its total norm once optimizer.step() has taken the step."""
        return self.clipping.ask(Request(max_norm=float(max_norm), norm_type=float(norm_type),
                                         error_if_nonfinite=error_if_nonfinite))

    def clip_gradients_value(self, module, optimizer, clip_val):
        self.clipping.ask(Request(clip_val=float(clip_val)))

    # -- evaluation: each rank its part of the batches (fabric/data.py) --------------------------
    def evaluation_shares(self) -> list[int]:
        """How an evaluation loader is split: the plan's shares, evenly before there is a plan."""
        engine = self.engine
        plan = engine.plan if engine is not None and self.pieces.steps is not None else None
        if plan is not None:
            refuse_sharded(self.pieces.module)
        return list(plan.shares) if plan is not None else [1] * self.world_size

    @contextmanager
    def evaluation_pass(self):
        self.evaluating += 1
        try:
            yield
        finally:
            self.evaluating -= 1

    # -- Fabric's collectives, on the job's process group ----------------------------------------
    def check_collective(self, name: str) -> None:
        """Inside a global step of Fabric's own loop ranks are at different batches (their shares
        differ), so a collective there would wait on a peer that never calls it: refused, with
        the place where every rank meets."""
        if self.evaluating and self.world_size > 1:
            raise UsageError(f"fabric.{name} inside a pass over an evaluation loader: under HetrainStrategy each rank "
                             "evaluates its own part of the batches, in its own number of batches, so its peers "
                             f"would not call it with it", f"call fabric.{name} after the evaluation loop (sum "
                             "there, then gather), or set the loader up with use_distributed_sampler=False")
        if self.plain.active and self.world_size > 1:
            raise UsageError(f"fabric.{name} inside a global step of Fabric's own loop under HetrainStrategy: each "
                             "rank runs its own number of batches a step, so its peers would not call it with it",
                             f"call fabric.{name} where optimizer.step() returned the step (`step = optimizer."
                             f"step()`, then `if step is not None: fabric.{name}(...)`), or read step.loss, the "
                             "global batch's loss on every rank")

    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        """In place, as Fabric's DDP does: 'mean'/'avg' sums and divides; other names are ReduceOps."""
        self.check_collective("all_reduce")
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        if isinstance(reduce_op, str):
            mean = reduce_op.lower() in ("mean", "avg")
            op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, reduce_op.upper())
        else:
            mean, op = False, dist.ReduceOp.SUM if reduce_op is None else reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if mean:
            n = dist.get_world_size(group)
            return tensor.div_(n) if torch.is_floating_point(tensor) else tensor.copy_(tensor / n)
        return tensor

    def all_gather(self, tensor, group=None, sync_grads=False):
        self.check_collective("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def barrier(self, name=None) -> None:
        self.check_collective("barrier")
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        self.check_collective("broadcast")
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave hetrain's job cleanly (a collective: every rank calls it). Fabric has no end of
        its own to hook this to."""
        if self.engine is not None:
            self.engine.close()

    def teardown(self) -> None:
        self.close()
        super().teardown()


def _check_config(global_batch, config: dict) -> None:
    """hetrain.init's keywords, checked when the strategy is made (Fabric(...) time), not at launch."""
    for name in config:
        if name in FROM_THE_LOADER:
            raise UsageError(f"HetrainStrategy({name}=...): the training DataLoader says it",
                             f"pass {name}= to the DataLoader you give fabric.setup_dataloaders")
    # an old or unknown keyword, then every value: one UsageError naming the fix (a stand-in for
    # a global batch the DataLoader will decide)
    make_config({"global_batch": 1 if global_batch is None else global_batch, **config}, where="HetrainStrategy")


# -- Fabric's accelerator, devices and num_nodes against the job `hetrain run` / torchrun started:
# checked before joining (check_world: a refused setting leaves no job behind) and once joined
# (check_device: this rank's device is hetrain's). Fabric's accelerator must be the device type
# the job's ranks run on: CPU ranks need accelerator='cpu', CUDA ranks 'cuda'. ----------------------
def check_world(strategy) -> None:
    """Fabric's accelerator, devices and num_nodes against what the launcher started, before
    joining: a refused setting leaves no job behind. CUDA ranks' accelerator is checked once joined
    (check_device): a GPU asked for that this host lacks is hetrain.init's error to name."""
    if strategy.ranks_device_type() == "cpu" and not isinstance(strategy.accelerator, CPUAccelerator):
        raise UsageError(f"Fabric chose {type(strategy.accelerator).__name__}, but this job's ranks run on the CPU, "
                         "one process each", "pass Fabric(accelerator='cpu')")
    devices, nodes = len(strategy.parallel_devices or ()), strategy.num_nodes
    if isinstance(strategy.accelerator, CPUAccelerator) and devices == 1 and nodes == 1:
        return        # Fabric's CPU default ('auto' is one device): CPU ranks, one per process
    world = env_rank()[1]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    job_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if devices != local or nodes != job_nodes:
        raise UsageError(
            f"Fabric(devices={devices}, num_nodes={nodes}) but the job has {local} process(es) on this node and "
            f"{job_nodes} node(s) ({world} in all), as `hetrain run` / torchrun started them",
            f"pass Fabric(devices={local}, num_nodes={job_nodes}), or leave both at their defaults and launch one "
            "process per device with `hetrain run`")


def check_device(strategy, engine) -> None:
    """Fabric's accelerator and this rank's device against the one hetrain runs it on."""
    device = engine.device
    wanted = CUDAAccelerator if device.type == "cuda" else CPUAccelerator
    if not isinstance(strategy.accelerator, wanted):
        raise UsageError(
            f"Fabric's accelerator is {type(strategy.accelerator).__name__}, but hetrain runs rank {engine.rank} on "
            f"{device}",
            "pass Fabric(accelerator='cpu')" if device.type == "cpu"
            else "pass Fabric(accelerator='cuda'), or leave it at 'auto'")
    if device.type == "cuda":    # check_world saw one Fabric device per local process
        fabric_device = strategy.parallel_devices[engine.ctx.local_rank]
        if fabric_device != device:
            raise UsageError(f"Fabric's devices put local rank {engine.ctx.local_rank} on {fabric_device}, "
                             f"hetrain on {device} (one process per visible GPU, in order)",
                             "choose the GPUs with CUDA_VISIBLE_DEVICES and leave Fabric's devices at 'auto'")


# -- the drop-in -----------------------------------------------------------------------------------
class Fabric(LightningFabric):
    """`from hetrain.integrations.lightning import Fabric`: the one line a stock Fabric script
    changes. Fabric(...) as Lightning's, with HetrainStrategy as its strategy, joined to the job at
    construction, as `fabric run` joins Fabric's own processes: a script written for `fabric run`
    (no fabric.launch()) runs under `hetrain run` unchanged; fabric.launch() is then a no-op.
    `strategy=HetrainStrategy(...)` passes hetrain's settings (global_batch, precision, grad_clip,
    memory, ...); 'auto' and 'ddp' are HetrainStrategy() (DDP with uneven shares). Its accelerator
    'auto' is the device type the job's ranks run on. Every other argument is Fabric's."""

    def __init__(self, *, strategy="auto", accelerator="auto", **kwargs):
        if isinstance(strategy, str) and strategy in ("auto", "ddp"):
            strategy = HetrainStrategy()
        elif not isinstance(strategy, HetrainStrategy):
            raise UsageError(f"Fabric(strategy={strategy!r}) from hetrain.integrations.lightning: it runs hetrain's "
                             "strategy, DDP with uneven shares across the job's devices",
                             "drop strategy=, or pass strategy=HetrainStrategy(...) for hetrain's settings")
        if accelerator == "auto" and strategy.ranks_device_type() == "cpu":
            accelerator = "cpu"     # Lightning's 'auto' would take a GPU of this host that the ranks do not run on
        super().__init__(strategy=strategy, accelerator=accelerator, **kwargs)
        if not self._launched:
            self._strategy.setup_environment()     # joins hetrain's job (collective), as Fabric's CLI does
            self._launched = True
