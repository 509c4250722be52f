"""`aiopipe.transport` re-exports exactly the public names of its modules."""

from __future__ import annotations

import importlib

import aiopipe.transport

MODULES = ("base", "fabric", "guard", "memory", "network", "peering", "websocket")


def test_exports_are_complete_and_resolve() -> None:
    exported = aiopipe.transport.__all__
    assert len(set(exported)) == len(exported)
    public: set[str] = set()
    for name in MODULES:
        module = importlib.import_module(f"aiopipe.transport.{name}")
        public.update(module.__all__)
        for item in module.__all__:
            assert getattr(aiopipe.transport, item) is getattr(module, item)
    assert set(exported) == public
