"""The model zoo: PiPar's six models (pipar.txt Tables 2–3) and a small GPT, by name.

``build(name, num_classes=..., in_shape=...)`` returns the model; its split units are
the top-level children of an ``nn.Sequential`` for the image models (the unit counts are
those of pipar.txt §5.4), and what `aiopipe.models.split_units` cuts for ``gpt-tiny``:

=====================  =====  ============================  ========
name                   units  module                        in_shape
=====================  =====  ============================  ========
``vgg5``               5      `aiopipe.models.vgg`          C×H×W
``resnet18``           10     `aiopipe.models.resnet`       C×H×W
``mobilenetv3-small``  15     `aiopipe.models.mobilenet`    C×H×W
``vgg16``              16     `aiopipe.models.vgg`          C×H×W
``resnet101``          35     `aiopipe.models.resnet`       C×H×W
``mobilenetv3-large``  19     `aiopipe.models.mobilenet`    C×H×W
``gpt-tiny``           7 [*]  `aiopipe.models.gpt`          T
=====================  =====  ============================  ========

[*] ``split_units(model, several=True)``: the embedding, four blocks, the final norm and
the head; each cut between blocks passes two tensors (the residual stream and the
padding mask). With one-tensor cuts (`aiopipe.models.as_units`) it is 3 units.

Every image model takes any ``C×H×W`` input with ``H, W >= 4`` (1×28×28 MNIST, 3×32×32
CIFAR, 3×64×64 Tiny ImageNet, ...): VGG computes its flatten size from ``in_shape``, the
others end in a global average pool. ``gpt-tiny`` takes windows of ``T`` tokens,
``2 <= T <= 1024`` (its learned positions are sized by ``T``), and ``num_classes`` is
its vocabulary (256 for bytes). Initialization draws only from torch's global generator,
so ``torch.manual_seed(s)`` before `build` makes the weights reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from aiopipe.errors import ConfigError
from aiopipe.models.gpt import build_gpt_tiny
from aiopipe.models.mobilenet import build_mobilenetv3_large, build_mobilenetv3_small
from aiopipe.models.resnet import build_resnet18, build_resnet101
from aiopipe.models.trace import split_units
from aiopipe.models.vgg import build_vgg5, build_vgg16

__all__ = ["MAX_CONTEXT", "MIN_CONTEXT", "MIN_SIDE", "MODEL_NAMES", "build"]

#: The smallest input height and width every image model accepts.
MIN_SIDE = 4
#: The shortest and longest windows (tokens) ``gpt-tiny`` accepts.
MIN_CONTEXT = 2
MAX_CONTEXT = 1024

#: (classes, in_shape as given) -> model, after checking in_shape for that model
_Builder = Callable[[int, object], nn.Sequential]


def _images(builder: Callable[[int, tuple[int, int, int]], nn.Sequential]) -> _Builder:
    return lambda classes, in_shape: builder(classes, _checked_shape(in_shape))


def _tokens(builder: Callable[[int, tuple[int]], nn.Module]) -> _Builder:
    return lambda classes, in_shape: split_units(builder(classes, _checked_context(in_shape)))


_BUILDERS: dict[str, _Builder] = {
    "gpt-tiny": _tokens(build_gpt_tiny),
    "mobilenetv3-large": _images(build_mobilenetv3_large),
    "mobilenetv3-small": _images(build_mobilenetv3_small),
    "resnet101": _images(build_resnet101),
    "resnet18": _images(build_resnet18),
    "vgg16": _images(build_vgg16),
    "vgg5": _images(build_vgg5),
}

#: The names `build` knows, sorted.
MODEL_NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def build(name: str, *, num_classes: int, in_shape: Sequence[int]) -> nn.Sequential:
    """Build the zoo model ``name`` for ``num_classes`` classes (a vocabulary, for
    ``gpt-tiny``) and inputs of shape ``in_shape``, freshly initialized from torch's
    global generator.

    The result is an ``nn.Sequential`` whose top-level children are the split units:
    an image model's own, ``gpt-tiny``'s traced from its `aiopipe.models.gpt.GPT`
    (`aiopipe.models.split_units`: embed, each block, norm, head; the mask and the
    residual stream cross between blocks).

    Raises:
        ConfigError: ``name`` is not one of `MODEL_NAMES` (the message lists them),
            ``num_classes`` is not an integer >= 1, or ``in_shape`` does not suit the
            model: three integers (channels >= 1, height and width >= `MIN_SIDE`) for an
            image model, one (`MIN_CONTEXT` <= T <= `MAX_CONTEXT`) for ``gpt-tiny``.
    """
    builder = _BUILDERS.get(name) if isinstance(name, str) else None
    if builder is None:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be an integer >= 1; got {num_classes!r}")
    return builder(num_classes, in_shape)


def _checked_shape(in_shape: object) -> tuple[int, int, int]:
    problem = (
        f"in_shape must be (channels, height, width) with channels >= 1 and "
        f"height, width >= {MIN_SIDE}; got {in_shape!r}"
    )
    if not isinstance(in_shape, Sequence) or isinstance(in_shape, str | bytes):
        raise ConfigError(problem)
    ints = [v for v in in_shape if isinstance(v, int) and not isinstance(v, bool)]
    if len(in_shape) != 3 or len(ints) != 3:
        raise ConfigError(problem)
    channels, height, width = ints
    if channels < 1 or height < MIN_SIDE or width < MIN_SIDE:
        raise ConfigError(problem)
    return (channels, height, width)


def _checked_context(in_shape: object) -> tuple[int]:
    problem = (f"in_shape must be (T,), a window of T tokens with {MIN_CONTEXT} <= T <= "
               f"{MAX_CONTEXT}; got {in_shape!r}")
    if not isinstance(in_shape, Sequence) or isinstance(in_shape, str | bytes):
        raise ConfigError(problem)
    if len(in_shape) != 1:
        raise ConfigError(problem)
    (context,) = in_shape
    if (isinstance(context, bool) or not isinstance(context, int)
            or not MIN_CONTEXT <= context <= MAX_CONTEXT):
        raise ConfigError(problem)
    return (context,)
