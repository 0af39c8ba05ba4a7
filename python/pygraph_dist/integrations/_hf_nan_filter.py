"""``PGDTrainer``'s ``logging_nan_inf_filter`` on the device (``hf.PGDTrainer.train``
says why): the Trainer's rule as a tensor expression, and the check that the
installed transformers' loop is the one that rule mirrors. Kept apart from
``hf.py``, which wires Accelerate and the Trainer to ``wrap()``."""

from __future__ import annotations

import inspect

import torch

_FITS: dict[type, bool] = {}  # transformers.Trainer -> whether its loop is the one mirrored


def nan_filtered(loss: torch.Tensor, tr_loss: torch.Tensor, steps: int) -> torch.Tensor:
    """What the Trainer's ``logging_nan_inf_filter`` adds to its running loss
    ``tr_loss``, computed on the device: ``loss`` where it is finite, else
    ``tr_loss / steps`` (the average of the losses since the last log), the
    Trainer's own expression. ``tr_loss += nan_filtered(...)`` is then the
    Trainer's ``if isnan or isinf: tr_loss += tr_loss / steps else: tr_loss +=
    loss``, without reading the loss on the host. ``loss``: 0-dim, on
    ``tr_loss``'s device (``PGDTrainer.training_step`` leaves other losses to
    the Trainer's own check)."""
    return torch.where(torch.isfinite(loss), loss, tr_loss / steps)


def fits(trainer: type, cls: type, pgd_trainer: type) -> bool:
    """Whether the filter can move to the device for a ``cls`` trainer:
    transformers' ``trainer`` loop is the one :func:`nan_filtered` mirrors (the
    running loss in ``self._tr_loss``, the filter adding ``self._tr_loss / (1 +
    global_step - _globalstep_last_logged)``, the option read once, after
    ``training_step`` and before ``floating_point_ops``: transformers 5), and
    ``cls`` runs that loop with ``pgd_trainer``'s ``training_step`` and
    ``floating_point_ops`` (a subclass that changes the loss after them, or
    the loop itself, keeps the Trainer's host check)."""
    if trainer not in _FITS:
        source = ""
        for name in ("_inner_training_loop", "_run_epoch"):  # the loop's body is in _run_epoch (5.x)
            try:
                source += inspect.getsource(getattr(trainer, name))
            except (OSError, TypeError, AttributeError):
                pass
        expression = "self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)"
        check, step = source.find("self.args.logging_nan_inf_filter"), source.find("self.training_step(")
        flops = source.find("self.floating_point_ops(inputs)", max(check, 0))
        _FITS[trainer] = (expression in source and "self._tr_loss += tr_loss_step" in source
                          and 0 <= step < check < flops and source.count("self.args.logging_nan_inf_filter") == 1)
    return (_FITS[trainer] and cls.training_step is pgd_trainer.training_step
            and cls.floating_point_ops is pgd_trainer.floating_point_ops
            and all(getattr(cls, name, None) is getattr(trainer, name, None)
                    for name in ("_inner_training_loop", "_run_epoch")))
