"""VGG-5 and VGG-16 as sequences of split units (pipar.txt Tables 2–3).

VGG-5 (5 units, no batch norm, PyTorch's default initialization):

====  ==========================================  ============================
unit  layers                                      output (3×32×32 input)
====  ==========================================  ============================
1     conv 3×3, 32 · ReLU · max-pool 2            32×16×16
2     conv 3×3, 64 · ReLU · max-pool 2            64×8×8
3     conv 3×3, 64 · ReLU                         64×8×8
4     flatten · FC 128 · ReLU                     128
5     FC X                                        X
====  ==========================================  ============================

VGG-16 (16 units): thirteen "conv 3×3 · batch norm · ReLU" units with 64, 64, 128, 128,
256, 256, 256 and six times 512 channels; units 2, 4, 7, 10 and 13 end with a 2×2
max-pool (``ceil_mode`` so a 1×1 map stays 1×1 on small inputs); then "flatten · FC 4096
· ReLU", "FC 4096 · ReLU" and "FC X". There is no dropout anywhere, so a forward pass in
training mode is a function of the input and the weights alone, however the pipeline
orders micro-batches. The flatten size is computed from the input shape.
"""

from __future__ import annotations

from torch import nn

__all__ = ["build_vgg5", "build_vgg16"]

_VGG16_CHANNELS = (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)
_VGG16_POOL_AFTER = frozenset({2, 4, 7, 10, 13})


def build_vgg5(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """VGG-5: 5 units; the caller has validated the arguments (raises nothing itself)."""
    channels, height, width = in_shape
    flat = 64 * (height // 4) * (width // 4)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(flat, 128), nn.ReLU()),
        nn.Linear(128, num_classes),
    )


def build_vgg16(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """VGG-16 with batch norm: 16 units; the caller has validated the arguments."""
    channels, height, width = in_shape
    units: list[nn.Module] = []
    for index, out_channels in enumerate(_VGG16_CHANNELS, start=1):
        layers: list[nn.Module] = [
            nn.Conv2d(channels, out_channels, 3, padding=1),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        ]
        if index in _VGG16_POOL_AFTER:
            layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))
            height, width = -(-height // 2), -(-width // 2)
        units.append(nn.Sequential(*layers))
        channels = out_channels
    units.append(nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, 4096), nn.ReLU()))
    units.append(nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()))
    units.append(nn.Linear(4096, num_classes))
    model = nn.Sequential(*units)
    _init_vgg16(model)
    return model


def _init_vgg16(model: nn.Module) -> None:
    # torchvision's VGG initialization.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
            nn.init.zeros_(module.bias)
