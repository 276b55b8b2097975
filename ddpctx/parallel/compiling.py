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

A mapping is checked when the model is wrapped, before anything is compiled
(torch would say some of it only at the first forward, some never):
:func:`check_compile_options`. Its keys are ``torch.compile``'s own keyword
arguments, read from its signature; the values of those ddpctx knows have their
types (``fullgraph`` a bool, ...); a ``backend`` name is one torch has; ``mode``
is one of inductor's modes; ``options`` go to the inductor backend, so each key
is one of ``torch._inductor.config``'s settings, of its type; another backend
takes them only if its compiler has an ``options`` parameter (``aot_eager``
would ignore them). Each refusal names ``compile=``, the key, the value and the fix.

>>> compile_options(True), compile_options({"backend": "aot_eager"}), compile_options(False)
({}, {'backend': 'aot_eager'}, None)
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
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
        options = dict(setting)
        check_compile_options(options, call)
        return options
    raise TypeError(
        f"{call}(compile={setting!r}): pass True (torch.compile's defaults), False, or a dict "
        "of torch.compile's keyword arguments, e.g. compile={'backend': 'aot_eager'} or "
        "compile={'mode': 'max-autotune'}."
    )


#: The types of the ``torch.compile`` arguments ddpctx checks (the others pass as given).
#: A bool is never taken for a number (``recompile_limit=True``).
KNOWN_TYPES: dict[str, tuple[type, ...]] = {
    "fullgraph": (bool,),
    "dynamic": (bool, type(None)),
    "mode": (str, type(None)),
    "options": (dict, type(None)),
    "name": (str, type(None)),
    "disable": (bool,),
    "recompile_limit": (int, type(None)),
    "isolate_recompiles": (bool,),
}
#: ``options`` keys ``torch.compile`` takes out itself, not inductor settings.
COMPILE_OWN_OPTIONS = frozenset({"guard_filter_fn", "use_aoti"})


def torch_compile_arguments() -> list[str]:
    """The keyword arguments of this torch's ``torch.compile`` (``model`` aside)."""
    parameters = inspect.signature(torch.compile).parameters
    return [name for name in parameters if name != "model"]


def check_compile_options(options: Mapping[str, Any], call: str = "ctx.wrap") -> None:
    """Refuse what ``torch.compile(**options)`` would refuse late, or ignore.

    >>> check_compile_options({"fullgraph": "yes"})
    Traceback (most recent call last):
    ...
    TypeError: ctx.wrap(compile=...): 'fullgraph': 'yes' is of type str; torch.compile takes bool there. Pass e.g. compile={'fullgraph': True}.
    """  # noqa: E501
    where = f"{call}(compile=...)"
    known = torch_compile_arguments()
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"{where}: {key!r} (= {value!r}) is not an argument of torch.compile (torch "
                f"{torch.__version__} takes {', '.join(known)}). {hint}Remove it; an inductor "
                f"setting goes in compile={{'options': {{{key!r}: {value!r}}}}}."
            )
        kinds = KNOWN_TYPES.get(key)
        if kinds is not None and (
            not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
        ):
            names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)
            example = {bool: True, str: "default", int: 8, dict: {}}[kinds[0]]
            raise TypeError(
                f"{where}: {key!r}: {value!r} is of type {type(value).__name__}; torch.compile "
                f"takes {names} there. Pass e.g. compile={{{key!r}: {example!r}}}."
            )
    backend = options.get("backend")
    if backend is not None and not isinstance(backend, str) and not callable(backend):
        raise TypeError(
            f"{where}: 'backend': {backend!r} is neither a backend's name nor a compiler "
            "function. Pass e.g. compile={'backend': 'inductor'} (torch._dynamo.list_backends())."
        )
    inductor = backend is None or backend == "inductor"
    compiler = _backend_compiler(backend, where) if isinstance(backend, str) else backend
    if options.get("mode") is not None and options.get("options") is not None:
        raise ValueError(
            f"{where}: 'mode': {options['mode']!r} and 'options' together; torch.compile takes "
            "one of them. Keep 'options' and add the mode's settings to it "
            "(torch._inductor.list_mode_options(mode)), or keep 'mode' alone."
        )
    if inductor and options.get("mode") is not None:
        from torch._inductor import list_mode_options

        modes = sorted(list_mode_options())
        if options["mode"] not in modes:
            raise ValueError(
                f"{where}: 'mode': {options['mode']!r} is not one of inductor's modes "
                f"({', '.join(modes)}). Pass one of them, e.g. compile={{'mode': 'default'}}."
            )
    if options.get("options"):
        _check_backend_options(options["options"], inductor, backend, compiler, where)


def _backend_compiler(name: str, where: str) -> Callable[..., Any]:
    """The compiler function of the backend named ``name``; a ValueError for a name torch lacks."""
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        compiler: Callable[..., Any] = lookup_backend(name)
    except InvalidBackend:
        names = [known for known in list_backends(None) if "TESTING" not in known]
        raise ValueError(
            f"{where}: 'backend': {name!r} is not a torch.compile backend here (torch "
            f"{torch.__version__} has {', '.join(names)}). Pass one of them, e.g. "
            "compile={'backend': 'inductor'}, or install the package that registers it."
        ) from None
    return compiler


def _check_backend_options(
    settings: dict[Any, Any],
    inductor: bool,
    backend: object,
    compiler: Callable[..., Any] | None,
    where: str,
) -> None:
    """``compile={'options': settings}``: inductor's settings, or a backend that takes options.

    A backend of torch's, named, takes them when its compiler has an ``options``
    parameter (its ``**kwargs`` swallow them unread); a compiler function of yours
    also when it has ``**kwargs``.
    """
    if not inductor:
        try:
            parameters = inspect.signature(compiler).parameters if compiler is not None else {}
        except (TypeError, ValueError):  # a signature Python cannot read: torch will say
            return
        swallows = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        if "options" not in parameters and (isinstance(backend, str) or not swallows):
            fate = (
                "torch would pass them and it would ignore them"
                if isinstance(backend, str)
                else "torch would call it with options=, a TypeError at the first forward"
            )
            raise ValueError(
                f"{where}: 'options': {settings!r} with 'backend': {backend!r}, which takes "
                f"no options ({fate}). Drop 'options', or use compile={{'backend': "
                "'inductor', 'options': ...}."
            )
        return
    from torch._inductor import config

    current = config.get_config_copy()
    for key, value in settings.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name in COMPILE_OWN_OPTIONS:
            continue
        if name not in current:
            close = difflib.get_close_matches(str(name), list(current), n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ValueError(
                f"{where}: 'options' key {key!r} (= {value!r}) is not an inductor setting of "
                f"torch {torch.__version__}{hint}. Fix the name (torch._inductor.config lists "
                "them) or remove it."
            )
        kind = config.get_type(name)  # type: ignore[attr-defined]
        if isinstance(kind, type) and not isinstance(value, kind):
            raise TypeError(
                f"{where}: 'options' key {key!r}: {value!r} is of type {type(value).__name__}; "
                f"inductor's {name} takes {kind.__name__} (now {current[name]!r}). Pass a "
                f"{kind.__name__}."
            )


def compile_in_place(modules: Iterable[nn.Module], options: Mapping[str, Any]) -> None:
    """Compile each module's forward in place (its identity and parameter names unchanged)."""
    for module in modules:
        module.compile(**options)
