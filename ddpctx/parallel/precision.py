"""The run's numeric precision: one ``precision=`` switch, applied where the model is made parallel.

=================  ==========================================  ==================================
``precision``      ``ctx.wrap`` (DDP)                           ``ctx.shard`` (FSDP2)
=================  ==========================================  ==================================
``"32"``           float32, as without the switch               float32
``"bf16-mixed"``   forward under ``torch.autocast(bfloat16)``   ``MixedPrecisionPolicy``: bf16
                   float32 weights, outputs cast to float32     compute, float32 gradient reduce,
                                                                and autocast (float32 buffers)
``"16-mixed"``     autocast(float16) + ``ctx.scaler``           the same, float16, + ``ctx.scaler``
                   (a ``GradScaler``; CUDA only)                (CUDA only)
``"bf16-true"``    weights and compute in bfloat16              weights and compute in bfloat16
=================  ==========================================  ==================================

Under ``"bf16-true"`` floating inputs are cast to bfloat16 on their way into
the model (batches from any loader stay as they are). Outputs are float32 in
every mode, so a loss computed from them is float32 too. ``ctx.scaler`` is a
``GradScaler`` that is enabled only under ``"16-mixed"`` (a pass-through
otherwise), so ``ctx.scaler.scale(loss).backward(); ctx.scaler.step(opt);
ctx.scaler.update()`` is correct code in every mode. float16 without CUDA is
refused with the fix: CPUs have no float16 autocast worth training with;
bfloat16 autocast works on CPU.

This module knows torch and nothing of the context.

Example:
    >>> policy = resolve_precision("bf16-mixed", torch.device("cpu"))
    >>> policy.name, policy.compute_dtype
    ('bf16-mixed', torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

PrecisionName = Literal["32", "bf16-mixed", "16-mixed", "bf16-true"]
PRECISIONS: tuple[str, ...] = ("32", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass(frozen=True)
class Precision:
    """One of :data:`PRECISIONS` on one device type; how to apply it."""

    name: str
    device_type: str

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward computes in."""
        if self.name.startswith("bf16"):
            return torch.bfloat16
        return torch.float16 if self.name == "16-mixed" else torch.float32

    @property
    def mixed(self) -> bool:
        return self.name.endswith("-mixed")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for a mixed precision, else a no-op block.

        >>> with resolve_precision("32", torch.device("cpu")).autocast():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
        """
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def scaler(self) -> torch.amp.GradScaler:
        """A ``GradScaler``, enabled only for ``"16-mixed"``."""
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "16-mixed")

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy: compute in bf16/fp16, reduce gradients and return outputs in float32."""
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy  # 0.7 s: only when sharding

        return MixedPrecisionPolicy(
            param_dtype=self.compute_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
        )

    def fsdp_kwargs(
        self, fsdp_kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Set the root's ``mp_policy`` in ``fsdp_kwargs``; return the blocks' and batch norms'.

        Only the root casts its output to float32: blocks hand bf16 on to
        the next block. Batch norm's running statistics are float32
        buffers, so its weights must be too. Nothing when the user passed
        ``mp_policy`` or the precision has none.
        """
        policy = self.fsdp_policy()
        if policy is None or "mp_policy" in fsdp_kwargs:
            return {}, None
        fsdp_kwargs["mp_policy"] = policy
        float32 = dataclasses.replace(policy, param_dtype=None, output_dtype=None)
        return {"mp_policy": dataclasses.replace(policy, output_dtype=None)}, {"mp_policy": float32}

    def prepare(self, model: nn.Module) -> nn.Module:
        """Cast the weights for ``"bf16-true"``; leave them float32 otherwise."""
        return model.to(torch.bfloat16) if self.name == "bf16-true" else model

    def wrap_forward(self, model: nn.Module) -> nn.Module:
        """Give ``model``'s forward the run's precision, with float32 outputs.

        Mixed precisions run the forward under autocast, also for a sharded
        model: FSDP2's policy casts the parameters and inputs, but not the
        buffers, so a float32 buffer met in the forward (a rotary table
        combined with bf16 queries) would otherwise give float32 next to bf16
        -- autocast resolves it as it does under DDP. ``"bf16-true"`` casts
        floating inputs to bfloat16, as the weights are, so float32 batches
        from any loader work. Under ``"32"`` the model is left alone.
        """
        if self.name == "bf16-true" or self.mixed:
            model.forward = _precision_forward(model, self)
        return model


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def _to_bfloat16(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.bfloat16)
    return value


def _precision_forward(model: nn.Module, precision: Precision) -> Callable[..., Any]:
    cast_inputs = precision.name == "bf16-true"

    # The class's forward, looked up per call: a forward patched on the class later still counts.
    @functools.wraps(type(model).forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if cast_inputs:
            args, kwargs = tree_map(_to_bfloat16, (args, kwargs))
        with precision.autocast():
            output = type(model).forward(model, *args, **kwargs)
        return tree_map(_to_float32, output)

    return forward


def resolve_precision(value: object, device: torch.device) -> Precision:
    """Check ``precision=`` against the device; every refusal names the fix.

    >>> resolve_precision("16-mixed", torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: precision='16-mixed' needs CUDA (float16 ...
    """
    name = "32" if value in (32, "32-true") else value
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(
            f"precision={value!r} is not one of {', '.join(map(repr, PRECISIONS))}. Use '32' "
            "(the default), 'bf16-mixed' (CPU and recent GPUs), '16-mixed' (CUDA) or 'bf16-true'."
        )
    if name == "16-mixed" and device.type != "cuda":
        raise ValueError(
            f"precision={value!r} needs CUDA (float16 autocast and GradScaler), and this run's "
            f"device is {str(device)!r}. Use precision='bf16-mixed' on CPU, or run on GPUs."
        )
    return Precision(name, device.type)
