"""``compile=`` on ``ctx.wrap`` and ``ctx.shard``: ``torch.compile`` in the order torch advises.

- ``ctx.wrap(model, compile=...)``: the DDP module is compiled after wrapping
  (so dynamo's DDP optimizer splits the graph at DDP's bucket boundaries and
  the gradient all-reduce overlaps the backward, as with
  ``torch.compile(DDP(model))``);
- ``ctx.shard(model, compile=...)``: each block ddpctx shards is compiled
  before ``fully_shard`` (the per-block recipe of FSDP2: repeated blocks reuse
  one compiled graph, and the FSDP2 hooks stay outside it); a model sharded as
  one root, with no block, is compiled whole.

Every compile is **in place** (``nn.Module.compile``): the module keeps its
identity, its class and its parameter names, so checkpoints,
``ctx.full_state_dict``, ``load_weights`` and export never see the
``_orig_mod.`` prefix that ``torch.compile(model)``'s wrapper adds, a
checkpoint saved compiled loads uncompiled and back, and every ``ctx``
method that looks for DDP or FSDP2 still finds it.

``compile=True`` uses ``torch.compile``'s defaults (inductor); a mapping is
passed to it as keyword arguments (``{"backend": "aot_eager"}``,
``{"mode": "max-autotune"}``, ...). The first steps pay the compile time.

>>> compile_options(True), compile_options({"backend": "aot_eager"}), compile_options(False)
({}, {'backend': 'aot_eager'}, None)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

#: What ``compile=`` accepts.
CompileSetting = bool | Mapping[str, Any] | None


def compile_options(setting: object, call: str = "ctx.wrap") -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for ``compile=setting``; None: no compile."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return {}
    if isinstance(setting, Mapping) and all(isinstance(key, str) for key in setting):
        return dict(setting)
    raise TypeError(
        f"{call}(compile={setting!r}): pass True (torch.compile's defaults), False, or a dict "
        "of torch.compile's keyword arguments, e.g. compile={'backend': 'aot_eager'} or "
        "compile={'mode': 'max-autotune'}."
    )


def compile_in_place(modules: Iterable[nn.Module], options: Mapping[str, Any]) -> None:
    """Compile each module's forward in place (its identity and parameter names unchanged)."""
    for module in modules:
        module.compile(**options)
