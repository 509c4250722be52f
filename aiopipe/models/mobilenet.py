"""MobileNetV3-Small and -Large as sequences of split units (pipar.txt Tables 2–3).

The block configurations are torchvision's (width multiplier 1.0), one inverted-residual
block ("bneck") per unit:

- unit 1: conv 3×3/2, 16 · batch norm · hardswish;
- one unit per bneck: Small has 11 (16, 24×2, 40×3, 48×2, 96×3 output channels),
  Large has 15 (16, 24×2, 40×3, 80×4, 112×2, 160×3);
- "CONV-1-576" / "CONV-1-960": conv 1×1 · batch norm · hardswish;
- "CONV-1-1024" / "CONV-1-1280": global average pool · flatten · FC · hardswish (a 1×1
  convolution on a 1×1 map, written as the equivalent linear layer as torchvision does);
- last unit: FC X.

So Small has 1 + 11 + 3 = 15 units and Large 1 + 15 + 3 = 19. Two deliberate departures
from torchvision: no dropout before the classifier (a forward pass in training mode is
then a function of input and weights alone, whatever order the pipeline runs
micro-batches in), and batch-norm momentum 0.1 instead of 0.01, so the running
statistics used for evaluation settle within the few hundred steps of a federated run.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

__all__ = ["InvertedResidual", "build_mobilenetv3_large", "build_mobilenetv3_small"]

_BN_EPS = 0.001


class _Bneck(NamedTuple):
    kernel: int
    expanded: int
    out: int
    se: bool
    hardswish: bool
    stride: int


# (kernel, expanded channels, output channels, squeeze-excite, hardswish, stride)
_SMALL = (
    _Bneck(3, 16, 16, True, False, 2),
    _Bneck(3, 72, 24, False, False, 2),
    _Bneck(3, 88, 24, False, False, 1),
    _Bneck(5, 96, 40, True, True, 2),
    _Bneck(5, 240, 40, True, True, 1),
    _Bneck(5, 240, 40, True, True, 1),
    _Bneck(5, 120, 48, True, True, 1),
    _Bneck(5, 144, 48, True, True, 1),
    _Bneck(5, 288, 96, True, True, 2),
    _Bneck(5, 576, 96, True, True, 1),
    _Bneck(5, 576, 96, True, True, 1),
)
_LARGE = (
    _Bneck(3, 16, 16, False, False, 1),
    _Bneck(3, 64, 24, False, False, 2),
    _Bneck(3, 72, 24, False, False, 1),
    _Bneck(5, 72, 40, True, False, 2),
    _Bneck(5, 120, 40, True, False, 1),
    _Bneck(5, 120, 40, True, False, 1),
    _Bneck(3, 240, 80, False, True, 2),
    _Bneck(3, 200, 80, False, True, 1),
    _Bneck(3, 184, 80, False, True, 1),
    _Bneck(3, 184, 80, False, True, 1),
    _Bneck(3, 480, 112, True, True, 1),
    _Bneck(3, 672, 112, True, True, 1),
    _Bneck(5, 672, 160, True, True, 2),
    _Bneck(5, 960, 160, True, True, 1),
    _Bneck(5, 960, 160, True, True, 1),
)


class SqueezeExcitation(nn.Module):
    """Channel attention: scale each channel by hardsigmoid(FC(ReLU(FC(mean))))."""

    def __init__(self, channels: int, squeeze: int) -> None:
        """Build the gate; raises nothing."""
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gate; raises what torch raises for a wrong input shape."""
        scale: Tensor = self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))
        return x * scale


class InvertedResidual(nn.Module):
    """MobileNetV3 bneck: expand 1×1, depthwise k×k, optional SE, project 1×1; one unit."""

    def __init__(
        self,
        in_channels: int,
        kernel: int,
        expanded: int,
        out_channels: int,
        *,
        se: bool,
        hardswish: bool,
        stride: int,
    ) -> None:
        """Build the block (skip connection when shape is kept); raises nothing."""
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != in_channels:
            layers += _conv_bn_act(in_channels, expanded, 1, 1, hardswish=hardswish)
        layers += _conv_bn_act(
            expanded, expanded, kernel, stride, hardswish=hardswish, depthwise=True
        )
        if se:
            layers.append(SqueezeExcitation(expanded, _make_divisible(expanded // 4)))
        layers += [
            nn.Conv2d(expanded, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels, eps=_BN_EPS),
        ]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block; raises what torch raises for a wrong input shape."""
        out: Tensor = self.block(x)
        return out + x if self.residual else out


def build_mobilenetv3_small(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """MobileNetV3-Small: 15 units; the caller has validated the arguments."""
    return _build(_SMALL, 1024, num_classes, in_shape[0])


def build_mobilenetv3_large(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """MobileNetV3-Large: 19 units; the caller has validated the arguments."""
    return _build(_LARGE, 1280, num_classes, in_shape[0])


def _build(
    config: tuple[_Bneck, ...], hidden: int, num_classes: int, in_channels: int
) -> nn.Sequential:
    units: list[nn.Module] = [nn.Sequential(*_conv_bn_act(in_channels, 16, 3, 2, hardswish=True))]
    channels = 16
    for b in config:
        units.append(
            InvertedResidual(
                channels,
                b.kernel,
                b.expanded,
                b.out,
                se=b.se,
                hardswish=b.hardswish,
                stride=b.stride,
            )
        )
        channels = b.out
    last = 6 * channels
    units.append(nn.Sequential(*_conv_bn_act(channels, last, 1, 1, hardswish=True)))
    units.append(
        nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(last, hidden), nn.Hardswish()
        )
    )
    units.append(nn.Linear(hidden, num_classes))
    model = nn.Sequential(*units)
    _initialize(model)
    return model


def _conv_bn_act(
    in_channels: int,
    out_channels: int,
    kernel: int,
    stride: int,
    *,
    hardswish: bool,
    depthwise: bool = False,
) -> list[nn.Module]:
    groups = in_channels if depthwise else 1
    return [
        nn.Conv2d(
            in_channels, out_channels, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False
        ),
        nn.BatchNorm2d(out_channels, eps=_BN_EPS),
        nn.Hardswish() if hardswish else nn.ReLU(),
    ]


def _make_divisible(value: int, divisor: int = 8) -> int:
    # torchvision's rounding of the squeeze-excitation width to a multiple of 8.
    rounded = max(divisor, (value + divisor // 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _initialize(model: nn.Module) -> None:
    # torchvision's MobileNetV3 initialization.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
            nn.init.zeros_(module.bias)
