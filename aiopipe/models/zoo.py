"""The model zoo: PiPar's six models (pipar.txt Tables 2–3) by name.

``build(name, num_classes=..., in_shape=...)`` returns an ``nn.Sequential`` whose
top-level children are the split units; the unit counts are those of pipar.txt §5.4:

=====================  =====  ============================
name                   units  module
=====================  =====  ============================
``vgg5``               5      `aiopipe.models.vgg`
``resnet18``           10     `aiopipe.models.resnet`
``mobilenetv3-small``  15     `aiopipe.models.mobilenet`
``vgg16``              16     `aiopipe.models.vgg`
``resnet101``          35     `aiopipe.models.resnet`
``mobilenetv3-large``  19     `aiopipe.models.mobilenet`
=====================  =====  ============================

Every model takes any ``C×H×W`` input with ``H, W >= 4`` (1×28×28 MNIST, 3×32×32 CIFAR,
3×64×64 Tiny ImageNet, ...): VGG computes its flatten size from ``in_shape``, the others
end in a global average pool. Initialization draws only from torch's global generator, so
``torch.manual_seed(s)`` before `build` makes the weights reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from aiopipe.errors import ConfigError
from aiopipe.models.mobilenet import build_mobilenetv3_large, build_mobilenetv3_small
from aiopipe.models.resnet import build_resnet18, build_resnet101
from aiopipe.models.vgg import build_vgg5, build_vgg16

__all__ = ["MIN_SIDE", "MODEL_NAMES", "build"]

#: The smallest input height and width every model accepts.
MIN_SIDE = 4

_Builder = Callable[[int, tuple[int, int, int]], nn.Sequential]

_BUILDERS: dict[str, _Builder] = {
    "mobilenetv3-large": build_mobilenetv3_large,
    "mobilenetv3-small": build_mobilenetv3_small,
    "resnet101": build_resnet101,
    "resnet18": build_resnet18,
    "vgg16": build_vgg16,
    "vgg5": build_vgg5,
}

#: The names `build` knows, sorted.
MODEL_NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def build(name: str, *, num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """Build the zoo model ``name`` for ``num_classes`` classes and ``C×H×W`` inputs.

    The result is an ``nn.Sequential`` whose top-level children are the split units,
    freshly initialized from torch's global generator.

    Raises:
        ConfigError: ``name`` is not one of `MODEL_NAMES` (the message lists them),
            ``num_classes`` is not an integer >= 1, or ``in_shape`` is not three integers
            (channels >= 1, height and width >= `MIN_SIDE`).
    """
    builder = _BUILDERS.get(name) if isinstance(name, str) else None
    if builder is None:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be an integer >= 1; got {num_classes!r}")
    return builder(num_classes, _checked_shape(in_shape))


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
