"""Hugging Face Accelerate and ``transformers.Trainer`` on pygraph_dist.

An Accelerate loop changes only where the Accelerator is created::

    from pygraph_dist.integrations.hf import PGDAccelerator
    accelerator = PGDAccelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    # the loop as before: accelerator.accumulate(model), accelerator.backward(loss),
    # accelerator.clip_grad_norm_(...), optimizer.step(), scheduler.step(), accelerator.gather(...)

and a Trainer only where the Trainer is created::

    from pygraph_dist.integrations.hf import PGDTrainer
    trainer = PGDTrainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=ds)
    trainer.train()

Keyword arguments of :func:`pygraph_dist.wrap` (``graphs=False``, ``warmup``,
``bucket_cap_mb``, ...) may be given to either; the rest go to Accelerate or
the Trainer unchanged.

Why this mechanism. Accelerate creates ``DistributedDataParallel`` in
``Accelerator.prepare_model`` (and nothing at world size 1), where
``pygraph_dist.wrap`` must go instead — and ``wrap`` needs the model *and* its
optimizer, which ``prepare()`` receives in one call. So :class:`PGDAccelerator`
is a subclass that overrides only ``prepare`` (pair each model with its
optimizer, let Accelerate place the model and patch its forward with its own
autocast, then ``wrap`` the pair instead of DDP, at every world size) and
``prepare_model`` (Accelerate's own preparation without the DDP). Everything
else — ``backward``, ``accumulate`` (Accelerate calls the prepared model's
``no_sync()``, which pygraph_dist's wrapper has, as DDP's), ``clip_grad_norm_``,
the AcceleratedOptimizer and AcceleratedScheduler, ``gather``/``reduce``,
checkpointing — is Accelerate's code, unchanged. Mixed precision is
Accelerate's too: its autocast is part of the module's ``forward``, so it runs
inside the graphs, and the arithmetic is bitwise what Accelerate's own does.

``transformers.Trainer`` takes no Accelerator and no Accelerator class: it
builds ``Accelerator(**args)`` inside ``create_accelerator_and_postprocess``
from ``TrainingArguments``. :class:`PGDTrainer` lets that method run as
written (every argument and post-processing step of the installed
transformers version), then changes the class of the accelerator it built to
:class:`PGDAccelerator` — which adds no state that Accelerate's ``__init__``
would have set up — the in-place class change ``pygraph_dist.wrap`` also uses
for optimizers. The Trainer creates its optimizer in ``create_optimizer`` and
passes it with the model to ``accelerator.prepare(model, optimizer)``, where
the pair is wrapped. No method of the Trainer's loop is replaced, so
``gradient_accumulation_steps``, ``max_grad_norm``, ``bf16``, the lr scheduler,
logging and evaluation are the Trainer's own; only ``logging_nan_inf_filter``'s
per-step host read becomes the same rule on the device (``PGDTrainer.train``).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

import pygraph_dist as pgd
from pygraph_dist import GraphedModule
from pygraph_dist.step import clip_route
from pygraph_dist.runtime import patches
from pygraph_dist.loop.config import OPTIONS, sparse_param_names

from . import _hf_nan_filter

EXTRA_HINT = "pip install pygraph_dist[hf]"

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        f"pygraph_dist.integrations.hf needs Hugging Face accelerate (and transformers for "
        f"PGDTrainer): {EXTRA_HINT}. ({exc})") from exc

logger = logging.getLogger("pygraph_dist")

__all__ = ["PGDAccelerator", "PGDTrainer", "split_wrap_options"]

# Keyword arguments of pygraph_dist.wrap(): these go to wrap(), everything else to Accelerate/Trainer.
WRAP_OPTIONS = frozenset(OPTIONS)
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def split_wrap_options(kwargs: dict) -> tuple[dict, dict]:
    """``(wrap options, the rest)`` of a keyword dict; refuses ``amp=``, which
    the frameworks set their own way."""
    wrap_options = {k: kwargs.pop(k) for k in list(kwargs) if k in WRAP_OPTIONS}
    if "amp" in wrap_options:
        raise ValueError(
            "amp= is not a PGDAccelerator/PGDTrainer option: mixed precision is Accelerate's "
            "(Accelerator(mixed_precision='bf16'), TrainingArguments(bf16=True)); its autocast runs "
            "inside the graphs.")
    return wrap_options, kwargs


class PGDAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare`` wraps each model with its
    optimizer by :func:`pygraph_dist.wrap` instead of DistributedDataParallel.

    Pass each model together with its optimizer to the same ``prepare()`` call.
    Keyword arguments that are ``pygraph_dist.wrap`` options go to ``wrap``;
    the others to ``Accelerator``. Without a process group, one is created
    with :func:`pygraph_dist.init` (torchrun's variables, or one process).
    """

    def __init__(self, *args, **kwargs) -> None:
        wrap_options, kwargs = split_wrap_options(dict(kwargs))
        _ensure_process_group()  # before Accelerate's PartialState, which then uses it
        super().__init__(*args, **kwargs)
        self._pgd_configure(wrap_options)

    def _pgd_configure(self, wrap_options: dict) -> None:
        """The state PGDAccelerator adds (also called after PGDTrainer's class change)."""
        self.pgd_wrap_options = dict(wrap_options)
        self._pgd_preparing = False

    # ------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        """As ``Accelerator.prepare``; models that train come back as pygraph_dist's
        ``GraphedModule`` (their optimizer made graph-aware in place), not DDP."""
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            return super().prepare(*args, device_placement=device_placement)  # Accelerate's error
        args = list(args)
        for mi, oi in _pairs(args):
            _ensure_process_group()
            self._check_supported()
            self._pgd_preparing = True
            try:
                model = self.prepare_model(args[mi], device_placement=device_placement[mi])
            finally:
                self._pgd_preparing = False
            graphed, _ = pgd.wrap(model, _inner(args[oi]), **self._pgd_options())
            if graphed.engine.device.type == "cuda" and graphed.engine.fp_backend is None and self.is_main_process:
                logger.info("the process group uses torch's own NCCL backend (created before pygraph_dist "
                            "could): graphs work, without collective fingerprints; call pygraph_dist.init() "
                            "before creating the Accelerator or TrainingArguments for the graph-safe backend")
            if model in self._models:  # Accelerate's registry holds the wrapper, as it holds DDP
                self._models.remove(model)
            args[mi] = graphed
            if self.is_main_process:
                logger.info("accelerate: %s wrapped by pygraph_dist instead of %s%s", type(model).__name__,
                            "DistributedDataParallel" if self.use_distributed else "nothing (one process)",
                            f"; Accelerate's {self.mixed_precision} autocast runs inside the module's forward "
                            f"(pygraph_dist's own amp stays off; report(): 'autocast {self.mixed_precision} "
                            "inside the model's forward')"
                            if self.native_amp else "")
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        """Accelerate's preparation (device placement, its autocast patched into
        ``forward``, ``torch.compile`` when configured) without DDP; a model that
        trains must come to ``prepare()`` with its optimizer."""
        if isinstance(model, GraphedModule):
            if model not in self._models:
                self._models.append(model)
            return model
        if not any(p.requires_grad for p in model.parameters()):
            # Nothing to reduce: no wrapper (Accelerate's MULTI_CPU branch would try DDP, which refuses it).
            evaluation_mode = True
        if evaluation_mode:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        if not self._pgd_preparing:
            raise ValueError(
                f"PGDAccelerator: pass the {type(model).__name__} together with its optimizer to one "
                "accelerator.prepare(model, optimizer, ...) call: pygraph_dist wraps a model and its "
                "optimizer as a pair. (A model only evaluated: prepare_model(model, evaluation_mode=True).)")
        # evaluation_mode=True is Accelerate's preparation minus the DDP/FSDP wrapping.
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's module, as Accelerate unwraps DDP (state dicts without ``module.``)."""
        if isinstance(model, GraphedModule):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """As Accelerate's, except for the parameters of a model wrapped with
        ``max_grad_norm`` (``PGDTrainer`` sets it from ``TrainingArguments.max_grad_norm``;
        ``PGDAccelerator(max_grad_norm=...)`` for an Accelerate loop): those are
        clipped inside the optimizer step, in the graph, with the same
        ``clip_grad_norm_``. Returns the norm before clipping, as Accelerate's:
        at once when the step already ran (tier 1), else a tensor that
        ``optimizer.step()`` fills (NaN until then; the Trainer logs it after
        the step)."""
        # The Trainer passes model.parameters() every step: read once (clip_route.parameters_of).
        cached = clip_route.parameters_of(parameters)
        if cached is not None:
            parameters = cached
        else:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        model = self._pgd_model_of(parameters)
        configured = model.engine.step.max_grad_norm if model is not None else None
        if configured is None:  # Accelerate's, which calls torch's: moved into the step where it can be
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)  # (clip_route.py)
        # The step clips every trainable parameter of the model (frozen ones have no gradient):
        # the call must ask for the same, or clipping would happen twice or over another set.
        # The model's own tuple, all of them (an empty tuple is every empty tuple: not evidence).
        covers = bool(parameters) and parameters is clip_route.cached_parameters(model)
        if not covers:
            passed = {id(p) for p in parameters}
            covers = all(id(p) in passed for p in model.parameters() if p.requires_grad)
        if float(max_norm) != configured or float(norm_type) != 2.0 or not covers:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) on a model that "
                f"pygraph_dist clips inside the optimizer step with max_grad_norm={configured} (norm 2, "
                "over all its trainable parameters)"
                + ("" if covers else ", over only part of those parameters")
                + ": clipping twice would train differently. Pass the same max_norm and the model's "
                "parameters, or leave max_grad_norm out of the PGDAccelerator/PGDTrainer options.")
        return model.engine.grad_norm_after_step()

    def _pgd_model_of(self, parameters: list) -> GraphedModule | None:
        """The prepared pygraph_dist model any of ``parameters`` belongs to."""
        for model in self._models:
            if (isinstance(model, GraphedModule) and parameters
                    and parameters is clip_route.cached_parameters(model)):
                return model
        ids = {id(p) for p in parameters}
        for model in self._models:
            if isinstance(model, GraphedModule) and any(id(p) in ids for p in model.parameters()):
                return model
        return None

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model):
        """Accelerate's DDP-only switch; refused for a pygraph_dist model (its
        reduction is decided at the model call, as ``no_sync()`` says)."""
        if isinstance(model, GraphedModule):
            raise NotImplementedError(
                "trigger_sync_in_backward() reaches into DDP's reducer; with pygraph_dist, make the last "
                "micro-batch's model call outside accelerator.no_sync(model): its backward all-reduces "
                "the accumulated gradients.")
        with Accelerator.trigger_sync_in_backward(model):
            yield

    # ------------------------------------------------------------ internals
    def _check_supported(self) -> None:
        parallelism = getattr(self, "parallelism_config", None)  # accelerate >= 1.10
        if self.distributed_type not in _SUPPORTED or getattr(self, "is_fsdp2", False) or (
                parallelism is not None and (parallelism.tp_enabled or parallelism.cp_enabled)):
            raise ValueError(
                f"PGDAccelerator replaces DistributedDataParallel (data parallelism) and cannot be combined "
                f"with {self.distributed_type}; use accelerate.Accelerator for FSDP, DeepSpeed, Megatron-LM, "
                "XLA or tensor parallelism.")
        if self.mixed_precision == "fp8":
            raise ValueError("PGDAccelerator: mixed_precision='fp8' is not supported; use 'bf16' or 'fp16'.")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.num_processes:
            raise ValueError(
                f"the process group has {world} ranks but Accelerate sees {self.num_processes} process(es), "
                "so its data loaders would not shard the data. On a machine without a GPU pass cpu=True "
                "(TrainingArguments(use_cpu=True)), which makes Accelerate use the CPU ranks.")

    def _pgd_options(self) -> dict:
        """wrap()'s options: the user's, then what the DDP kwargs handler asked of DDP."""
        options = dict(self.pgd_wrap_options)
        handler = self.ddp_handler
        if handler is not None:
            options.setdefault("bucket_cap_mb", handler.bucket_cap_mb)
            options.setdefault("broadcast_buffers", handler.broadcast_buffers)
            hook = getattr(handler.comm_hook, "value", handler.comm_hook)
            if hook == "bf16":
                # DDP's bf16_compress_hook: the same arithmetic (README: grad_comm_dtype).
                options.setdefault("grad_comm_dtype", torch.bfloat16)
            elif hook not in (None, "no"):
                raise ValueError(
                    f"DistributedDataParallelKwargs(comm_hook={hook!r}) is a DDP communication hook; "
                    "pygraph_dist reduces gradients itself and supports bf16 compression only "
                    "(comm_hook='bf16' or grad_comm_dtype=torch.bfloat16).")
        return options


def _inner(optimizer):
    """The torch optimizer inside Accelerate's wrapper, if it is wrapped already."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _pairs(args: list) -> list[tuple[int, int]]:
    """(model index, optimizer index) for each model among ``args`` that trains:
    the optimizer whose parameters all belong to it. Refuses a training model
    without one, and an optimizer spanning models."""
    models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module) and not isinstance(a, GraphedModule)
              and any(p.requires_grad for p in a.parameters())]
    optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)
                  and _inner(a).__dict__.get("_pgd_engine") is None]
    owners = {i: {id(p) for p in args[i].parameters()} for i in models}
    pairs = []
    for oi in optimizers:
        params = {id(p) for g in _inner(args[oi]).param_groups for p in g["params"]}
        match = [mi for mi in models if params <= owners[mi]]
        if not match:
            raise ValueError(
                "PGDAccelerator.prepare: an optimizer's parameters do not all belong to one model passed "
                "in the same prepare() call; pass each model with its own optimizer.")
        pairs.append((match[0], oi))
    paired = {mi for mi, _ in pairs}
    if len(paired) != len(pairs):
        raise ValueError("PGDAccelerator.prepare: two optimizers for one model; pygraph_dist wraps one "
                         "optimizer per model (use parameter groups).")
    missing = [type(args[mi]).__name__ for mi in models if mi not in paired]
    if missing:
        raise ValueError(
            f"PGDAccelerator.prepare: {', '.join(missing)} has trainable parameters but no optimizer in the "
            "same prepare() call; pygraph_dist wraps a model and its optimizer as a pair: "
            "accelerator.prepare(model, optimizer, ...).")
    return pairs


def _ensure_process_group() -> None:
    """pygraph_dist needs a process group, also for one process (Accelerate makes none)."""
    if not dist.is_initialized():
        pgd.init()


# -------------------------------------------------------------------- Trainer
try:
    import transformers as _transformers
except ImportError:  # PGDAccelerator works without transformers; PGDTrainer says what to install
    _transformers = None

if _transformers is not None:

    class PGDTrainer(_transformers.Trainer):
        """A ``transformers.Trainer`` that trains through pygraph_dist instead of DDP.

        Keyword arguments that are ``pygraph_dist.wrap`` options (``graphs=False``,
        ``warmup=...``) go to ``wrap``; the rest to ``Trainer``. Its Accelerator
        is the one ``Trainer`` builds from ``TrainingArguments``, made a
        :class:`PGDAccelerator` (see the module docstring for why)."""

        def __init__(self, *args, **kwargs) -> None:
            wrap_options, kwargs = split_wrap_options(dict(kwargs))
            self.pgd_wrap_options = wrap_options  # read by create_accelerator_and_postprocess
            self._pgd_model = kwargs.get("model", args[0] if args else None)  # the same, before Trainer sets it
            super().__init__(*args, **kwargs)
            if self.args.n_gpu > 1:
                # Trainer's own multi-GPU mode without a launcher wraps the model in nn.DataParallel
                # (Trainer._wrap_model) and never passes it to accelerator.prepare().
                raise ValueError(
                    f"PGDTrainer sees {self.args.n_gpu} GPUs in one process, where Trainer would use "
                    "nn.DataParallel; launch one process per GPU (torchrun --nproc-per-node=N, or "
                    "CUDA_VISIBLE_DEVICES=0 for one GPU).")
            # At more than one process compute_loss multiplies the model's loss by the process
            # count (average_tokens_across_devices): the same number at every step, which a
            # tier-1 graph seeds its backward with (conformance.scale_chain).

        def train(self, *args, **kwargs):
            """``Trainer.train``, with ``logging_nan_inf_filter`` applied on the device.

            The Trainer's filter reads every micro-batch's loss on the host
            (``torch.isnan(loss) or torch.isinf(loss)``): one wait for the GPU per
            micro-batch, which puts the Trainer's own Python after each graph
            replay instead of beside it. :meth:`training_step` applies the same
            rule with ``torch.where`` (a non-finite loss is replaced by what the
            Trainer would have added, the running average) and turns the option
            off for the host check that follows it; :meth:`floating_point_ops`,
            which the Trainer calls next, turns it on again. Callbacks,
            evaluation and saved arguments see it as set; logged losses are the
            same, bitwise. Only where this class's loop is transformers' own
            (``_hf_nan_filter.fits``)."""
            self._pgd_nan_filter = (bool(self.args.logging_nan_inf_filter)
                                    and _hf_nan_filter.fits(_transformers.Trainer, type(self), PGDTrainer))
            try:
                return super().train(*args, **kwargs)
            finally:
                self._pgd_nan_filter = False
                if self._pgd_filter_off:
                    self._pgd_filter_on()

        _pgd_nan_filter = False
        _pgd_filter_off = False

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if not self._pgd_nan_filter or loss.device != self._tr_loss.device or loss.dim() != 0:
                return loss  # the Trainer's own host check (and its device error)
            filtered = _hf_nan_filter.nan_filtered(loss, self._tr_loss,
                                                   1 + self.state.global_step - self._globalstep_last_logged)
            try:
                self.args.logging_nan_inf_filter = False  # for the host check right after this call
            except Exception:  # arguments that refuse changes: the host check stays, on the same value
                return loss
            self._pgd_filter_off = True
            return filtered

        def floating_point_ops(self, inputs):
            # The Trainer's next call after its nan/inf check (_run_epoch): the option as set again.
            if self._pgd_filter_off:
                self._pgd_filter_on()
            return super().floating_point_ops(inputs)

        def _pgd_filter_on(self) -> None:
            self.args.logging_nan_inf_filter = True
            self._pgd_filter_off = False

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            accelerator = self.accelerator
            if not isinstance(accelerator, PGDAccelerator):
                patches.swap_class(accelerator, PGDAccelerator, "accelerate.Accelerator.__class__")
                options = dict(getattr(self, "pgd_wrap_options", {}))
                clip = self.args.max_grad_norm
                model = getattr(self, "_pgd_model", None)
                sparse = model is not None and bool(sparse_param_names(
                    model, {n for n, p in model.named_parameters() if p.requires_grad}))
                if clip and clip > 0 and accelerator.scaler is None and not sparse:
                    # Trainer clips every optimizer step with this value (_clip_grad_norm): inside
                    # the step graph instead (PGDAccelerator.clip_grad_norm_). Not under fp16, whose
                    # GradScaler Accelerate unscales before clipping, between the graphs; not with
                    # sparse embeddings, whose gradients wrap() cannot clip inside the step.
                    options.setdefault("max_grad_norm", float(clip))
                accelerator._pgd_configure(options)
else:

    def __getattr__(name: str):
        if name == "PGDTrainer":
            raise ImportError(f"PGDTrainer needs Hugging Face transformers: {EXTRA_HINT}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
