"""Users' own code named as ``module:function``: models, losses, optimizers, data.

A run names a factory by where it lives, as a string that fits in TOML and on every
command line (``model = "mypkg.nets:small_cnn"``), so the server and every device build
the same thing from their own installed code. The module is imported on the node that
needs it (the current directory is importable when a node is started with ``python
-m``). A factory is called with the keyword arguments of its contract that it declares
(all of them when it takes ``**kwargs``): a factory that needs none of them may take
none.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from aiopipe.errors import ConfigError

__all__ = ["call_factory", "is_entry_point", "load_entry_point"]

_SPEC = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def is_entry_point(spec: object) -> bool:
    """Whether ``spec`` is written ``module:function`` (dotted names; nothing imported)."""
    return isinstance(spec, str) and _SPEC.fullmatch(spec) is not None


def load_entry_point(spec: str, *, what: str) -> Callable[..., Any]:
    """The callable ``spec`` (``package.module:name``, the name may be dotted) names.

    ``what`` names its role in errors ("model", "loss"...).

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported, it has no
            such attribute, or that is not callable.
    """
    if not is_entry_point(spec):
        raise ConfigError(f"{what} {spec!r}: expected module:function")
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{what} {spec!r}: cannot import {module_name}: "
                          f"{type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{what} {spec!r}: {module_name} has no {attribute}") from None
    if not callable(target):
        raise ConfigError(f"{what} {spec!r}: {attribute} is not callable")
    return target  # type: ignore[no-any-return]


def call_factory(factory: Callable[..., Any], spec: str, *, what: str,
                 **arguments: Any) -> Any:
    """``factory(**the arguments it declares)``.

    Raises:
        ConfigError: the call failed (the message names ``spec`` and the error).
    """
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): give it everything
        accepted = dict(arguments)
    else:
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            accepted = dict(arguments)
        else:
            names = {p.name for p in parameters if p.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
            accepted = {k: v for k, v in arguments.items() if k in names}
    try:
        return factory(**accepted)
    except Exception as exc:
        raise ConfigError(f"{what} {spec!r} failed: {type(exc).__name__}: {exc}") from None
