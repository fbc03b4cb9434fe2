"""ResNet-18 and ResNet-50 for 32x32 images, written once for both frameworks.

He et al.'s residual networks with the stem that CIFAR training uses instead of
ImageNet's: one 3x3 convolution of stride 1 and no max-pool, so that a 32x32 image keeps
its size through the first stage. Then four stages of 64, 128, 256 and 512 channels
(at ``width=64``) with strides 1, 2, 2, 2, a global average pool and a linear
classifier. ResNet-18 stacks basic blocks (two 3x3 convolutions) 2-2-2-2; ResNet-50
bottleneck blocks (1x1, 3x3, 1x1 convolutions, 4x wider at the output) 3-4-6-3. Where a
block changes the shape, the shortcut is a 1x1 convolution with batch norm.

The layers are the kit's (``kit.nn``: ``torch.nn`` or ``megengine.module``, which take
the same arguments for every layer used here), so this one definition builds the same
network on either framework: the same layers, parameter shapes and order. Weights start
from each framework's own default initialisation.
"""

from __future__ import annotations

from typing import Any

# name -> (block kind, blocks per stage)
ARCHITECTURES = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}
EXPANSION = {"basic": 1, "bottleneck": 4}


def _classes(kit: Any) -> dict[str, Any]:
    """The block and network classes on ``kit``'s framework (a class statement needs
    that framework's ``Module``); made once per kit through ``kit.define``."""
    nn = kit.nn

    def conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[Any]:
        return [nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2,
                          bias=False), nn.BatchNorm2d(c_out)]

    class Block(nn.Module):  # type: ignore[name-defined,misc]
        """A residual block: ``relu(body(x) + shortcut(x))``."""

        def __init__(self, kind: str, c_in: int, planes: int, stride: int) -> None:
            super().__init__()
            c_out = planes * EXPANSION[kind]
            if kind == "basic":
                layers = conv_bn(c_in, planes, 3, stride) + [nn.ReLU()] + \
                    conv_bn(planes, planes, 3)
            else:
                layers = conv_bn(c_in, planes, 1) + [nn.ReLU()] + \
                    conv_bn(planes, planes, 3, stride) + [nn.ReLU()] + \
                    conv_bn(planes, c_out, 1)
            self.body = nn.Sequential(*layers)
            self.shortcut = (nn.Sequential(*conv_bn(c_in, c_out, 1, stride))
                             if stride != 1 or c_in != c_out else nn.Identity())

        def forward(self, x: Any) -> Any:
            return kit.relu(self.body(x) + self.shortcut(x))

    class ResNet(nn.Module):  # type: ignore[name-defined,misc]
        """Stem, four stages of blocks, global average pool, linear classifier."""

        def __init__(self, kind: str, depths: tuple[int, ...], num_classes: int,
                     width: int) -> None:
            super().__init__()
            self.stem = nn.Sequential(*conv_bn(3, width, 3), nn.ReLU())
            blocks, c_in = [], width
            for stage, depth in enumerate(depths):
                planes = width * 2 ** stage
                for i in range(depth):
                    blocks.append(Block(kind, c_in, planes, 2 if stage and not i else 1))
                    c_in = planes * EXPANSION[kind]
            self.stages = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.flatten = kit.flatten()
            self.classifier = nn.Linear(c_in, num_classes)

        def forward(self, x: Any) -> Any:
            x = self.pool(self.stages(self.stem(x)))
            return self.classifier(self.flatten(x))

    return {"Block": Block, "ResNet": ResNet}


def resnet(kit: Any, name: str = "resnet18", num_classes: int = 10, width: int = 64) -> Any:
    """A CIFAR ResNet on ``kit``'s framework and device.

    Args:
        kit: a construction kit (``examples.frameworks.get()``).
        name: "resnet18" or "resnet50".
        num_classes: outputs of the classifier.
        width: channels of the stem and the first stage (64 in the paper; smaller for
            quick CPU trials and tests).

    Raises:
        ValueError: an unknown ``name`` or a ``width`` below 1.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(ARCHITECTURES)}.")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int (64 in the paper); got {width!r}.")
    kind, depths = ARCHITECTURES[name]
    return kit.place(kit.define(_classes)["ResNet"](kind, depths, num_classes, width))


def parameter_count(model: Any) -> int:
    """The number of trainable values in ``model`` (both frameworks' tensors have
    ``.shape``)."""
    total = 0
    for p in model.parameters():
        n = 1
        for d in p.shape:
            n *= int(d)
        total += n
    return total
