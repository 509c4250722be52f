"""ResNet-18 and ResNet-101 as sequences of split units (pipar.txt Tables 2–3).

The layers are torchvision's (ResNet v1.5: the stride of a bottleneck is on its 3×3
convolution), with one residual or bottleneck block per unit, because a block's skip
connection cannot be cut:

- unit 1, the stem: conv 7×7/2, 64 · batch norm · ReLU · max-pool 3×3/2 (÷4 spatially);
- one unit per block: ResNet-18 has 2+2+2+2 basic blocks (64, 128, 256, 512 channels),
  ResNet-101 has 3+4+23+3 bottleneck blocks (256, 512, 1024, 2048 output channels);
- last unit, the head: global average pool · flatten · FC X.

So ResNet-18 has 1 + 8 + 1 = 10 units and ResNet-101 1 + 33 + 1 = 35. (Table 3 of the
paper lists ResNet-101's blocks as 1 + 3 + 4 + 23 + 2 with shifted channel labels; the
total, 33 blocks, is the standard 3 + 4 + 23 + 3 used here.) The global pool makes the
head independent of the input size.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "build_resnet18", "build_resnet101"]


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a skip connection (ResNet-18/34); one split unit."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        """Build the block; raises nothing."""
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(in_channels, channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block; raises what torch raises for a wrong input shape."""
        out: Tensor = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = self.relu(out + self.downsample(x))
        return out


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3, 1×1 expand (×4) with a skip connection (ResNet-50+); one unit."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        """Build the block with ``width * 4`` output channels; raises nothing."""
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block; raises what torch raises for a wrong input shape."""
        out: Tensor = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out = self.relu(out + self.downsample(x))
        return out


def build_resnet18(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """ResNet-18: 10 units; the caller has validated the arguments (raises nothing)."""
    units: list[nn.Module] = [_stem(in_shape[0])]
    in_channels = 64
    for stage, channels in enumerate((64, 128, 256, 512)):
        for index in range(2):
            stride = 2 if stage > 0 and index == 0 else 1
            units.append(BasicBlock(in_channels, channels, stride))
            in_channels = channels
    units.append(_head(in_channels, num_classes))
    return _initialized(nn.Sequential(*units))


def build_resnet101(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """ResNet-101: 35 units; the caller has validated the arguments (raises nothing)."""
    units: list[nn.Module] = [_stem(in_shape[0])]
    in_channels = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 23), (512, 3))):
        for index in range(blocks):
            stride = 2 if stage > 0 and index == 0 else 1
            units.append(Bottleneck(in_channels, width, stride))
            in_channels = width * Bottleneck.expansion
    units.append(_head(in_channels, num_classes))
    return _initialized(nn.Sequential(*units))


def _stem(in_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 7, 2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
    )


def _head(in_channels: int, num_classes: int) -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


def _initialized(model: nn.Sequential) -> nn.Sequential:
    # torchvision's ResNet initialization (linear layers keep PyTorch's default).
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    return model
