"""Any one-input model as split units: trace its forward and cut it between children.

aiopipe splits an ``nn.Sequential`` of units (`aiopipe.models.split`). `split_units` gives
that shape to any other ``nn.Module`` whose ``forward`` takes its inputs as positional
tensors (the first unit takes several as one tuple, as the data gives them) and returns
one value, without copying anything: the units hold the model's own modules, parameters
and buffers.

Theory of operation:

1. *Trace.* ``torch.fx`` records ``forward`` as a graph. The model's top-level children
   (and the entries of a top-level ``nn.ModuleList`` or ``nn.ModuleDict``) are leaves:
   they are called, not traced into, so control flow inside a child is fine. The trace
   is made with every module in train mode and again in eval mode; if the two differ,
   ``forward`` reads ``self.training`` itself and a trace would freeze one of them.
2. *Cut.* Each call of a child after the first is a candidate cut. It is made at the
   latest point between that call and the previous child call where the fewest values
   are still needed later (plain operations there, ``torch.flatten``, ``x + y``, join
   the unit before); every such value crosses, as a tuple when there are several (a
   skip connection around the cut, a mask every block takes: `aiopipe.models.crossing`).
   A cut that would put a parameter or buffer in two units (a module called at two
   places, tied weights) is dropped: a tensor is trained on one node only.
3. *Build.* Each unit is a ``GraphModule`` of its slice of the graph, rooted at the
   model, so it holds the original objects under their original qualified names.

Why ``torch.fx`` and not ``torch.export``: fx keeps the module hierarchy and the very
parameter objects, needs no example input and is fast; export lowers everything to ATen
operators, needs an example input, and would need unflattening to find the children
again. Why not ``torch.fx.passes.split_module``: it passes every parameter or buffer
that ``forward`` reads directly (``x + self.pos_embed``) into the pieces as an extra
input held by the parent, so a unit would take several tensors and own no such
parameter, and it renames ``features.0`` to ``features_0``, changing the state-dict keys.
"""

from __future__ import annotations

import bisect
import inspect
import itertools
import operator
import re
from collections.abc import Iterator, Sequence

import torch
from torch import fx, nn

from aiopipe.errors import ConfigError
from aiopipe.models.split import as_sequential

__all__ = ["as_units", "split_here", "split_units"]

_TENSOR_CONSTANT = re.compile(r"_tensor_constant\d+")


def split_here(x: torch.Tensor) -> torch.Tensor:
    """Mark a cut in a model's ``forward``: ``x = split_here(x)`` (as torch's pipelining's
    ``pipe_split()``). Where a model calls it, `split_units` cuts there, and only there,
    instead of between its children; ``x`` must be the one value that crosses. Outside
    a trace it returns ``x`` itself."""
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", split_here, (x,), {})
    return x


def as_units(model: nn.Module | Sequence[nn.Module]) -> nn.Sequential:
    """A user's model as split units: an ``nn.Sequential`` or a list of units as they
    are (`as_sequential`), any other ``nn.Module`` traced and cut between its children
    (`split_units`).

    Raises:
        ConfigError: see `as_sequential` and `split_units`.
    """
    if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential | nn.ModuleList):
        return split_units(model)
    return as_sequential(model)


def split_units(module: nn.Module, *, at: Sequence[str] | None = None,
                several: bool = True) -> nn.Sequential:
    """``module`` as an ``nn.Sequential`` of split units that share its objects.

    An ``nn.Sequential`` is returned as it is (the same object). Any other module is
    traced (see the module docstring) and cut before every call of a top-level child,
    or where its ``forward`` calls `split_here`, or, with ``at``, only before the
    children named there (an entry of a top-level
    ``nn.ModuleList`` is named like ``"blocks.3"``). Chaining the units computes
    exactly ``module(x)``, and the units' parameters and buffers are ``module``'s own (a
    child that ``forward`` never calls is in no unit).

    What crosses a cut: every value computed before it and used after it (a skip
    connection, a mask, the model's second input), the fewest of them: the cut is made
    where the fewest cross, and a unit that takes or returns several takes or returns
    them as a tuple, in the order the model made them (`aiopipe.models.crossing`; the
    runtime carries the tuple). With ``several`` false a cut passes one tensor: cuts
    that cannot are dropped silently unless ``at`` asked for them, and a model with no
    such cut (a skip around everything) comes back as one unit.

    Raises:
        ConfigError: ``module`` is not an ``nn.Module``; ``at`` is given for an
            ``nn.Sequential``; its ``forward`` takes no input or variadic ones, or does
            not return one value; torch.fx cannot trace it or it branches on
            ``self.training``; ``at`` names something that is not a called child, or a
            cut that cannot be made (it says which values cross it).
    """
    if isinstance(module, nn.Sequential):
        if at is not None:
            raise ConfigError("an nn.Sequential is already split units; `at` applies to "
                              "other models, which are traced")
        return module
    if not isinstance(module, nn.Module):
        raise ConfigError(f"can only split an nn.Module; got {type(module).__name__}")
    name = type(module).__name__
    _check_signature(module, name)
    leaves = _children(module)
    nodes = list(_trace(module, frozenset(leaves), name).nodes)
    returned = nodes[-1].args[0]
    if not isinstance(returned, fx.Node):
        raise ConfigError(f"cannot split {name}: its forward returns a "
                          f"{type(returned).__name__}; aiopipe splits models of one "
                          "tensor output")
    flow = _Flow(nodes, returned)
    cuts = _cuts(flow, leaves, at, name, several=several)
    asked = at is not None or any(node.target is split_here for node in nodes)
    cuts = _unshared(module, flow, cuts, strict=asked, name=name)
    bounds = [0, *cuts, len(nodes)]
    return nn.Sequential(*(_unit(module, flow, a, b) for a, b in itertools.pairwise(bounds)))


class _LeafChildren(fx.Tracer):
    """A tracer that calls the named modules instead of tracing into them."""

    def __init__(self, leaves: frozenset[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (module_qualified_name in self.leaves
                or super().is_leaf_module(m, module_qualified_name))


class _Flow:
    """The traced nodes in order, and which values are still needed at each point."""

    def __init__(self, nodes: list[fx.Node], returned: fx.Node) -> None:
        self.nodes = nodes
        self.returned = returned
        index = {node: i for i, node in enumerate(nodes)}
        self.last_use = {node: max((index[u] for u in node.users), default=-1)
                         for node in nodes}

    def crossing(self, point: int) -> list[fx.Node]:
        """Values made before ``point`` (a node index) and used at or after it.
        Attributes are not values: any unit reads them from the model itself."""
        return [node for node in self.nodes[:point]
                if node.op != "get_attr" and self.last_use[node] >= point]


def _check_signature(module: nn.Module, name: str) -> None:
    params = list(inspect.signature(module.forward).parameters.values())
    variadic = [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        stars = "*" if variadic[0].kind is variadic[0].VAR_POSITIONAL else "**"
        raise ConfigError(f"cannot split {name}: its forward takes {stars}{variadic[0].name}; "
                          "aiopipe splits models of named positional inputs")
    if not params:
        raise ConfigError(f"cannot split {name}: its forward takes no input")


def _children(module: nn.Module) -> list[str]:
    """Qualified names of the modules ``forward`` can call as units, in order."""
    names: list[str] = []
    for child_name, child in module._modules.items():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            names += [f"{child_name}.{key}" for key in child._modules]
        elif child is not None:
            names.append(child_name)
    return names


def _trace(module: nn.Module, leaves: frozenset[str], name: str) -> fx.Graph:
    modes = {m: m.training for m in module.modules()}
    graphs: list[fx.Graph] = []
    try:
        for training in (True, False):
            for m in modes:
                m.training = training  # each flag alone: .train() would reset children
            graphs.append(_LeafChildren(leaves).trace(module))
    except Exception as exc:
        found = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ConfigError(
            f"cannot split {name}: torch.fx cannot trace its forward ({found}); make it an "
            "nn.Sequential of units, or move that code into a child module (children are "
            "called, not traced)") from exc
    finally:
        for m, training in modes.items():
            m.training = training
    # a tensor made in forward is stored on the model once per trace, under a new name
    # each time (``_tensor_constant0``, then ``1``): the same code, not a mode's branch
    if _TENSOR_CONSTANT.sub("_tensor_constant", str(graphs[0])) != _TENSOR_CONSTANT.sub(
            "_tensor_constant", str(graphs[1])):
        raise ConfigError(f"cannot split {name}: its forward reads self.training, which a "
                          "trace would freeze; move that code into a child module")
    return graphs[0]


def _cuts(flow: _Flow, leaves: list[str], at: Sequence[str] | None, name: str, *,
          several: bool = False) -> list[int]:
    """Node indices to cut before: after each `split_here` if ``forward`` calls it, else
    one per child call that can be a cut (``several``: where the fewest values cross)."""
    marks = [i for i, node in enumerate(flow.nodes)
             if node.op == "call_function" and node.target is split_here]
    if marks:
        return _marked_cuts(flow, marks, at, name, several=several)
    calls = [i for i, node in enumerate(flow.nodes)
             if node.op == "call_module" and node.target in leaves]
    called = [str(flow.nodes[i].target) for i in calls]
    for wanted in at or ():
        if wanted not in called:
            what = "is never called by forward" if wanted in leaves else "is not a child"
            raise ConfigError(f"cannot cut {name} before {wanted!r}: it {what} "
                              f"(its children: {', '.join(leaves)})")
        if wanted not in called[1:]:
            raise ConfigError(f"cannot cut {name} before {wanted!r}: it is the first "
                              "child called, so nothing comes before it")
    cuts: list[int] = []
    for previous, here in itertools.pairwise(calls):
        target = str(flow.nodes[here].target)
        if at is not None and target not in at:
            continue
        counts = {p: len(flow.crossing(p)) for p in range(here, previous, -1)}
        fewest = min(counts.values()) if several else 1
        point = next((p for p, n in counts.items() if n == fewest), None)
        if point is not None:
            cuts.append(point)
        elif at is not None:
            values = [node.name for node in flow.crossing(here)]
            raise ConfigError(f"cannot cut {name} before {target!r}: {len(values)} values "
                              f"cross it (fx nodes {', '.join(values)}) and a cut passes one "
                              "tensor")
    return cuts


def _marked_cuts(flow: _Flow, marks: list[int], at: Sequence[str] | None,
                 name: str, *, several: bool = False) -> list[int]:
    """A cut right after each `split_here` call, where its value must be the only one
    that crosses (``several``: or others with it).

    Raises:
        ConfigError: ``at`` given too, or other values cross a marked cut.
    """
    if at is not None:
        raise ConfigError(f"cannot split {name} both at its split_here() marks and at "
                          f"{list(at)}: choose one")
    for i in marks:
        values = [node.name for node in flow.crossing(i + 1)]
        if values != [flow.nodes[i].name] and not several:
            others = [v for v in values if v != flow.nodes[i].name]
            raise ConfigError(f"cannot split {name} at its split_here() mark "
                              f"{marks.index(i) + 1}: {', '.join(others)} cross it too "
                              "(fx nodes), and a cut passes one tensor")
    return [i + 1 for i in marks if i + 1 < len(flow.nodes) - 1]


def _unshared(module: nn.Module, flow: _Flow, cuts: list[int], *, strict: bool,
              name: str) -> list[int]:
    """``cuts`` less those that would put one parameter or buffer in two units."""
    names = {id(t): key for key, t in itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False))}
    spans: dict[int, tuple[int, int]] = {}  # id(tensor) -> first and last unit using it
    for i, node in enumerate(flow.nodes):
        unit = bisect.bisect_right(cuts, i)
        for tensor in _state_used(module, node):
            if id(tensor) not in names:  # a constant made in forward: any unit may read it
                continue
            first, last = spans.get(id(tensor), (unit, unit))
            spans[id(tensor)] = (min(first, unit), max(last, unit))
    kept: list[int] = []
    for k, point in enumerate(cuts, start=1):  # cut k starts unit k
        shared = [names[t] for t, (first, last) in spans.items() if first < k <= last]
        if not shared:
            kept.append(point)
        elif strict:
            raise ConfigError(f"cannot cut {name} before {flow.nodes[point].target!r}: "
                              f"{shared[0]!r} is used on both sides (a tensor lives in "
                              "one unit)")
    return kept


def _state_used(module: nn.Module, node: fx.Node) -> Iterator[torch.Tensor]:
    """The parameters and buffers that running ``node`` reads."""
    held = [module.get_submodule(str(node.target))] if node.op == "call_module" else []
    for source in node.all_input_nodes:
        if source.op == "get_attr":
            attr = operator.attrgetter(str(source.target))(module)
            if isinstance(attr, nn.Module):
                held.append(attr)
            elif isinstance(attr, torch.Tensor):
                yield attr
    for m in held:
        yield from itertools.chain(m.parameters(), m.buffers())


def _unit(module: nn.Module, flow: _Flow, start: int, stop: int) -> fx.GraphModule:
    """Nodes ``start .. stop - 1`` as a module of the values that cross its first cut
    in (one, or a tuple of several) and those that cross its last cut out (alike)."""
    nodes = flow.nodes
    incoming = ([n for n in nodes if n.op == "placeholder"] if start == 0
                else flow.crossing(start))
    outgoing = [flow.returned] if stop == len(nodes) else flow.crossing(stop)
    graph = fx.Graph()
    if len(incoming) == 1:
        env = {incoming[0]: graph.placeholder(incoming[0].name)}
    else:
        values = graph.placeholder("values")
        env = {node: graph.call_function(operator.getitem, (values, k))
               for k, node in enumerate(incoming)}

    def look_up(node: fx.Node) -> fx.Node:
        if node not in env and node.op == "get_attr":  # read where it is used
            env[node] = graph.get_attr(str(node.target))
        return env[node]

    for node in nodes[start:stop]:
        if node.op not in ("placeholder", "get_attr", "output"):
            env[node] = graph.node_copy(node, look_up)
    out = [look_up(node) for node in outgoing]
    graph.output(out[0] if len(out) == 1 else tuple(out))
    return fx.GraphModule(module, graph)
