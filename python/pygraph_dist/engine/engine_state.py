"""The engine as the rest of the package sees it between steps: the storages
the monitor must not mistake for the user's, the optimizer's state loaded
from a checkpoint, the report, and teardown.

None of this runs per step. :class:`EngineState` is a mixin of
:class:`~pygraph_dist.engine.engine.Engine`: it reads and writes the engine's
attributes (``reducer``, ``optimizer``, ``opt_plan``, ``loop``, ``cache``,
``runner``, ``step``, ``group``...). Callers: ``LoopState``'s monitor
(``owned_storages``), ``GraphedOptimizerMixin.load_state_dict``
(``on_optimizer_state_loaded``), ``report()`` (``describe``),
:mod:`~pygraph_dist.launch.lifetime` (``teardown``).
"""

from __future__ import annotations

import torch

from ..loop.compiled import describe as describe_compile
from ..loop.monitor import storage_ptr
from ..reports.model_notes import capture_divergences
from ..step.optim import prepare_optimizer

TORN_DOWN = "pygraph_dist was torn down (destroy_process_group or exit)"


class EngineState:
    """The engine's state for its callers outside the step (mixed into ``Engine``)."""

    def on_optimizer_state_loaded(self, extra) -> None:
        self.opt_plan = prepare_optimizer(self.optimizer, device=self.device, amp=self.amp,
                                          skip_nonfinite=self.config.skip_nonfinite,
                                          sparse=bool(self.reducer.sparse_params))
        if extra and self.grad_scaler is not None and "grad_scaler" in extra:
            self.grad_scaler.load_state_dict(extra["grad_scaler"])
        self.opt_state_version += 1

    def owned_storages(self) -> set[int]:
        """Storages of parameters, gradient buckets, optimizer state and lr tensors."""
        # The views too: at world size 1 they may be a graph's gradients (grad_adoption.py).
        tensors = list(self.reducer.params) + [b for b in self.reducer.buffers if b is not None]
        tensors += [v for v in self.reducer.views if v is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += [t for t in self.opt_plan.lr_tensors if t is not None]
        return {storage_ptr(t) for t in tensors} - {-1}

    # ================================================================== report
    def describe(self):
        """This model's :class:`~pygraph_dist.reports.reporting.ModelReport`."""
        from dataclasses import asdict

        from ..reports.reporting import ModelReport

        tier2 = ""
        if self.loop.verdict:
            loop = f"not graphable: {self.loop.verdict}"
        elif self.loop.probe_done and self.loop.split_reason:
            # What the check found; what ran is the signatures' (report.summarize).
            clip = tier2 = "; ".join(d for d in (self.split.describe_lane(), self.split_clip.describe()) if d)
            loop = (f"fits tier 2 (graphs per micro-batch, your code between them{'; ' + clip if clip else ''}); "
                    f"not tier 1 because: {self.loop.split_reason}")
        elif self.loop.probe_done:
            loop = f"conforms (checked over {self.config.probe} probe iterations)"
            if self.step.routed_clip is not None and self.graphs_possible:
                loop += f"; your {self.step.routed_clip.describe()}"
        else:
            loop = "not checked yet"
        stock = self.device.type == "cuda" and self.fp_backend is None and self.graphs_possible
        backend = "graph-safe (pgd_nccl, fingerprints on)" if self.fp_backend is not None else (
            "stock (collective fingerprints off)" if self.device.type == "cuda" else "cpu")
        graphs = self.cache.describe(self.reducer.kinds)
        graphs_replayed = any(g.replays for g in graphs if g.tier != "eval")
        return ModelReport(
            model=type(self.module).__name__, rank=self.rank, world_size=self.world_size,
            graphs_possible=self.graphs_possible, graphs_reason=self.graphs_reason, loop=loop,
            amp=self.amp.name + (" (fp32 casts in graphs: Triton)" if self.runner.widening
                                 and self.amp.enabled else ""),
            optimizer=self.step.optimizer_class.__name__,
            optimizer_changes=list(self.opt_plan.changes), buckets=self.reducer.describe(),
            backend=backend, eager_buckets=self.reducer.describe_eager(),
            graphs=graphs,
            skipped_steps=int(self.step.skipped.item()) if self.step.skipped is not None else None,
            compile=describe_compile(self.config.compile, self.compile_stats, self.compile_user),
            events=[asdict(e) for e in self.cache.events],
            accumulation=self.accum.describe(), stock_backend=stock,
            tier1_needs=self.loop.split_reason if self.loop.probe_done else "",
            inner_autocast=self.probe.inner_seen[0] if self.probe.inner_seen else "",
            tier2_user_code=tier2,
            numerics=capture_divergences(self.module) if graphs_replayed else [],
        )

    # ================================================================ teardown
    def teardown(self) -> None:
        """Release every graph (and with it NCCL's references to the communicator).

        Also drops the engine's hold on the process group and the cycles through
        it (reducer hooks on the parameters, the optimizer's back-reference), so
        that the group's C++ objects are destroyed when the process group is,
        not during interpreter exit, where destroying them occasionally aborted
        the process. The optimizer keeps working as a plain optimizer."""
        if self.closed:
            return
        self.closed = True
        self.watchdog.close()
        self.loop.stop()
        self.split_clip.release()
        if self.cache.release_all(TORN_DOWN) and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        if self._release_stream is not None:
            self._release_stream()  # its graphs are destroyed: another model may capture on it
        self.reducer.remove_hooks()
        self.reducer.group = None
        self.group = None
        self.step.group = None
        self.runner.group = None
        self.accum.group = None
        self.fp_backend = None
        self.runner.fp_backend = None
        self.optimizer.__dict__.pop("_pgd_engine", None)
