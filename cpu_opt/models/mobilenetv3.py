"""MobileNetV3-Large with torchvision's structure (conv-BN-hardswish stem; inverted residual
blocks: 1x1 expand, depthwise kxk, squeeze-excite with ReLU / hardsigmoid, 1x1 project, residual
when shapes allow; 1x1 conv to 960, average pool, classifier Linear-hardswish-dropout-Linear),
random weights with torchvision's initialisation and calibrated BN running stats.

``width_mult`` scales channels as torchvision does (the zoo's "small" size uses 0.5)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._common import calibrate_batchnorm, check_size


def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


@dataclass(frozen=True)
class BlockConfig:
    cin: int
    kernel: int
    expanded: int
    cout: int
    use_se: bool
    activation: str  # "RE" or "HS"
    stride: int


# torchvision's mobilenet_v3_large inverted_residual_setting
LARGE = [
    BlockConfig(16, 3, 16, 16, False, "RE", 1),
    BlockConfig(16, 3, 64, 24, False, "RE", 2),
    BlockConfig(24, 3, 72, 24, False, "RE", 1),
    BlockConfig(24, 5, 72, 40, True, "RE", 2),
    BlockConfig(40, 5, 120, 40, True, "RE", 1),
    BlockConfig(40, 5, 120, 40, True, "RE", 1),
    BlockConfig(40, 3, 240, 80, False, "HS", 2),
    BlockConfig(80, 3, 200, 80, False, "HS", 1),
    BlockConfig(80, 3, 184, 80, False, "HS", 1),
    BlockConfig(80, 3, 184, 80, False, "HS", 1),
    BlockConfig(80, 3, 480, 112, True, "HS", 1),
    BlockConfig(112, 3, 672, 112, True, "HS", 1),
    BlockConfig(112, 5, 672, 160, True, "HS", 2),
    BlockConfig(160, 5, 960, 160, True, "HS", 1),
    BlockConfig(160, 5, 960, 160, True, "HS", 1),
]
SIZES = {"full": dict(width_mult=1.0, num_classes=1000, image=224),
         "small": dict(width_mult=0.5, num_classes=100, image=64)}


class ConvBNAct(nn.Sequential):
    def __init__(self, cin, cout, kernel=3, stride=1, groups=1, act: type[nn.Module] | None = nn.Hardswish):
        layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        if act is not None:
            layers.append(act(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x):
        s = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return s * x


class InvertedResidual(nn.Module):
    def __init__(self, c: BlockConfig):
        super().__init__()
        self.use_res_connect = c.stride == 1 and c.cin == c.cout
        act = nn.Hardswish if c.activation == "HS" else nn.ReLU
        layers: list[nn.Module] = []
        if c.expanded != c.cin:
            layers.append(ConvBNAct(c.cin, c.expanded, 1, act=act))
        layers.append(ConvBNAct(c.expanded, c.expanded, c.kernel, c.stride, groups=c.expanded, act=act))
        if c.use_se:
            layers.append(SqueezeExcitation(c.expanded, make_divisible(c.expanded // 4, 8)))
        layers.append(ConvBNAct(c.expanded, c.cout, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        out = self.block(x)
        return out + x if self.use_res_connect else out


class MobileNetV3(nn.Module):
    def __init__(self, width_mult: float = 1.0, num_classes: int = 1000, last_channel: int = 1280,
                 dropout: float = 0.2):
        super().__init__()

        def ch(c):
            return make_divisible(c * width_mult, 8)

        blocks = [BlockConfig(ch(b.cin), b.kernel, ch(b.expanded), ch(b.cout), b.use_se, b.activation, b.stride)
                  for b in LARGE]
        layers: list[nn.Module] = [ConvBNAct(3, blocks[0].cin, 3, stride=2)]
        layers += [InvertedResidual(b) for b in blocks]
        last_conv = 6 * blocks[-1].cout
        layers.append(ConvBNAct(blocks[-1].cout, last_conv, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last_channel = make_divisible(last_channel * width_mult, 8)
        self.classifier = nn.Sequential(nn.Linear(last_conv, last_channel), nn.Hardswish(inplace=True),
                                        nn.Dropout(dropout, inplace=True), nn.Linear(last_channel, num_classes))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return self.classifier(x)


def make(size: str = "full") -> MobileNetV3:
    cfg = SIZES[check_size(size)]
    return MobileNetV3(width_mult=cfg["width_mult"], num_classes=cfg["num_classes"])


def build(size: str = "full", seed: int = 0) -> MobileNetV3:
    torch.manual_seed(seed)
    model = make(size)
    img = SIZES[size]["image"]
    return calibrate_batchnorm(model, torch.randn(4, 3, min(img, 128), min(img, 128)))


mobilenetv3 = build
