"""The model zoo: plain ``torch.nn`` modules used by the papers.

Every model is an ordinary module, so users can pass their own instead.
Shapes follow the papers' benchmarks (FedDyn authors' code unless noted):

============  ==========================================  =====================================
name          module                                      papers
============  ==========================================  =====================================
mlr           :class:`MultinomialLogisticRegression`      FedProx (MNIST, synthetic)
mlp           :class:`MLP` (784-200-200-10; 784-100-100)  FedDyn MNIST / EMNIST-L
cnn           :class:`FedDynCNN`                          FedDyn CIFAR-10/100
femnist_cnn   :class:`FemnistCNN`                         decaying-K FEMNIST
lstm          :class:`CharLSTM` (hidden 100 or 256)       FedDyn (100), FedProx (256) Shakespeare
gru           :class:`CharGRU` (2 x 256)                  decaying-K Shakespeare
resnet18_gn   :func:`resnet18_groupnorm`                  FedDyn appendix (CIFAR-10)
resnet18_bn   :func:`resnet18_batchnorm`                  FedBN, FedAvg with BatchNorm (CIFAR-10)
vgg11         :func:`vgg11`                               EFL (CIFAR-100)
quadratic     ``QuadraticObjective``                      decaying-K Section 3
============  ==========================================  =====================================

Each model is registered as a ``ModelEntry`` (``driftlab.models.registry``) by
``driftlab.models`` with its ``[model]`` config type, its build function and its
batched forward (``driftlab.models.batched``), exactly as a plugin registers a
model of its own.

Training backends: every model trains on both. The vectorized backend runs
each model's batched forward (``models/batched.py``, written with the layers of
``models/layers.py``) for a stack of clients, and ``torch.func.vmap`` for
modules without one. ``models/zoo_test.py`` checks that one round of every
model gives the same parameters on both backends (float64, 1e-10).

No dropout and no batch normalisation in the papers' models: a client's local
step is a function of its parameters and batch alone (a user's module with
dropout draws keyed per-client masks, ``backends/modes.py``), and batch
statistics are what the FedDyn authors replace with GroupNorm in ResNet-18.
``resnet18_bn`` (``models/resnet.py``) keeps torchvision's BatchNorm for the
experiments that study it (FedAvg with BatchNorm, FedBN): its running
statistics are buffers a run carries as state beside the parameters
(``simulation/backends/buffers.py``); it has no batched forward: the
vectorized backend trains it with ``vmap``, each client with its own buffers
(``simulation/backends/vectorized_buffers.py``), agreeing with the sequential
backend to rounding.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from driftlab.models import registry
from driftlab.models.registry import MAX_WIDTH, ModelSection, Width

# The ResNets live in models/resnet.py; their names stay importable from here (batched.py, users).
from driftlab.models.resnet import (  # noqa: F401
    BasicBlockBN,
    BasicBlockGN,
    ResNet18BN,
    ResNet18GN,
    resnet18_batchnorm,
    resnet18_groupnorm,
)


class MultinomialLogisticRegression(nn.Module):
    """``softmax(W x + b)`` on flattened inputs (FedProx's MNIST and synthetic model).

    Parameters: ``in_features * num_classes + num_classes``.
    """

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs.flatten(1))


class MLP(nn.Module):
    """Fully connected ReLU network, e.g. 784-200-200-10 for MNIST (FedDyn).

    Args:
        in_features: flattened input size.
        hidden: widths of the hidden layers, e.g. ``(200, 200)``.
        num_classes: output size.
    """

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        widths = (in_features, *hidden)
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs.flatten(1))


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


class FedDynCNN(nn.Module):
    """The FedDyn authors' CIFAR-10/100 CNN (``utils_models.py``, models ``cifar10``/``cifar100``).

    conv 5x5 in→64 (no padding), ReLU, max-pool 2; conv 5x5 64→64, ReLU,
    max-pool 2; flatten (64·5·5 = 1600 for 32x32 inputs); fc 1600→384, ReLU;
    fc 384→192, ReLU; fc 192→classes. No batch normalisation (the paper: "similar
    to McMahan et al. 2017 except that we don't use Batch Normalization"; its
    text says 394 neurons, the authors' code has 384).

    Parameters for CIFAR-10: 4,864 + 102,464 + 614,784 + 73,920 + 1,930 = 797,962.

    Args:
        num_classes: output size (10 or 100).
        in_channels: input channels (3 for CIFAR).
        image_size: input height and width (32 for CIFAR); sets the flattened size.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int | tuple[int, int] = 32) -> None:
        super().__init__()
        height, width = _pair(image_size)
        flat_h, flat_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
        if flat_h < 1 or flat_w < 1:
            raise ValueError(f"FedDynCNN needs inputs of at least 16x16 pixels, got {height}x{width}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=5)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=5)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = nn.Linear(64 * flat_h * flat_w, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(inputs)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class FemnistCNN(nn.Module):
    """The decaying-K paper's FEMNIST CNN (its Appendix B, Table 2).

    conv 3x3 stride 1 →32, ReLU, max-pool 2x2 stride 2; conv 3x3 stride 1 →64,
    ReLU, max-pool 2x2 stride 2; fc →512, ReLU; fc →classes (softmax in the loss).

    Choices the appendix leaves open (it was written for Keras, whose defaults we take):
    * padding: none ("valid", Keras's default), so a 28x28 LEAF image gives
      26 → 13 → 11 → 5 and a flattened size of 64·5·5 = 1600; ``padding=1``
      ("same") gives 64·7·7 = 3136;
    * output size: the table says 64 outputs, the text and data have 62
      classes (a-z, A-Z, 0-9); we use ``num_classes`` (62);
    * inputs: LEAF stores each image as 784 values; flat ``[N, 784]`` inputs
      are reshaped to ``[N, 1, 28, 28]`` (the text mentions 32x32: pass ``image_size=32``).

    Parameters (28x28, no padding, 62 classes): 320 + 18,496 + 819,712 + 31,806 = 870,334.
    """

    def __init__(
        self, num_classes: int = 62, in_channels: int = 1, image_size: int | tuple[int, int] = 28, padding: int = 0
    ) -> None:
        super().__init__()
        if padding not in (0, 1):
            raise ValueError(f"padding must be 0 ('valid', the Keras default) or 1 ('same'), got {padding}")
        self.in_channels, self.image_size = in_channels, _pair(image_size)
        flat = [((((size + 2 * padding - 2) // 2) + 2 * padding - 2) // 2) for size in self.image_size]
        if min(flat) < 1:
            raise ValueError(f"FemnistCNN needs inputs of at least 10x10 pixels, got {self.image_size}")
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3, padding=padding)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=padding)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = nn.Linear(64 * flat[0] * flat[1], 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs.reshape(inputs.shape[0], self.in_channels, *self.image_size)
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class _CharRNN(nn.Module):
    """Embedding → stacked RNN → the last time step's output → linear."""

    rnn_type: type[nn.Module] = nn.LSTM
    default_hidden = 100  # each subclass's paper width (the only default that differs)

    def __init__(
        self,
        vocab_size: int = 80,
        embedding_dim: int = 8,
        hidden: int | None = None,
        layers: int = 2,
        num_classes: int | None = None,
    ) -> None:
        super().__init__()
        hidden = self.default_hidden if hidden is None else hidden
        for name, value in (
            ("vocab_size", vocab_size),
            ("embedding_dim", embedding_dim),
            ("hidden", hidden),
            ("layers", layers),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.rnn = self.rnn_type(input_size=embedding_dim, hidden_size=hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes or vocab_size)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: ``[N, T]`` character ids (floating ids are cast to integers); returns ``[N, classes]``."""
        if inputs.is_floating_point():
            inputs = inputs.long()
        output, _ = self.rnn(self.embedding(inputs))
        return self.fc(output[:, -1, :])


class CharLSTM(_CharRNN):
    """Next-character LSTM: embedding(vocab, 8), 2-layer LSTM, last step → linear to the vocabulary.

    FedDyn (paper Appendix A.1 and ``utils_models.py``, model ``shakespeare``):
    ``nn.Embedding(80, 8)``, ``nn.LSTM(8, 100, num_layers=2)``, ``nn.Linear(100, 80)``
    on the last time step of 80-character windows; FedProx's ``stacked_lstm``
    uses 256 hidden units. Default ``hidden=100`` (FedDyn).

    Parameters (a PyTorch LSTM layer has ``4h·(in + h) + 8h``: two bias vectors):
    vocab 80, hidden 100: 640 + (4·100·108 + 800) + (4·100·200 + 800) + 8,080 = 133,520;
    hidden 256: 640 + (4·256·264 + 2,048) + (4·256·512 + 2,048) + 20,560 = 819,920.

    Args:
        vocab_size: number of character ids (80 for LEAF's Shakespeare).
        embedding_dim: 8 in all the papers.
        hidden: LSTM width, 100 (FedDyn) or 256 (FedProx).
        layers: stacked LSTM layers (2).
        num_classes: output size; defaults to ``vocab_size`` (next-character prediction).
    """

    rnn_type = nn.LSTM
    default_hidden = 100


class CharGRU(_CharRNN):
    """Next-character GRU (decaying-K paper, Appendix B, Table 3): embedding 8, two GRU layers of 256, linear.

    The paper (Keras) lists a 77-character vocabulary, tanh/sigmoid GRU
    activations (PyTorch's) and a softmax output (in the loss here).
    PyTorch's GRU applies the reset gate after the recurrent matrix product,
    which is Keras's ``reset_after=True`` (its TF2 default); both have two bias
    vectors per layer, ``3h·(in + h) + 6h`` parameters.

    Parameters (vocab 80, hidden 256): 640 + (3·256·264 + 1,536) + (3·256·512 + 1,536) + 20,560 = 620,240.
    """

    rnn_type = nn.GRU
    default_hidden = 256


VGG11_LAYOUT = (1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M")  # multiples of `width`: 64, M, 128, M, 256, 256, ...


class VGG11(nn.Module):
    """VGG-11 (Simonyan & Zisserman, configuration A) without batch normalisation, for CIFAR-sized inputs (EFL).

    Features: 3x3 convolutions (padding 1) each followed by ReLU, with 2x2
    max-pools: 64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M — a
    32x32 image leaves them as 512x1x1. Classifier (the usual CIFAR head, in
    place of ImageNet's 25088→4096→4096): 512→512, ReLU, 512→512, ReLU,
    512→classes. Without dropout (see the module docstring); EFL calls its
    model "a simplified version" of VGG-11 without further detail.

    Parameters (CIFAR, 100 classes): features 9,220,480 + classifier
    262,656 + 262,656 + 51,300 = 9,797,092 (9,750,922 for 10 classes).

    Args:
        num_classes: output size.
        in_channels: input channels.
        image_size: input height and width (32); must be a multiple of 32.
        width: channels of the first convolution (64); the others scale with it
            (2x, 4x, 8x), as does the classifier's hidden width (8x). For tests.
    """

    def __init__(
        self, num_classes: int, in_channels: int = 3, image_size: int | tuple[int, int] = 32, width: int = 64
    ) -> None:
        super().__init__()
        height, image_width = _pair(image_size)
        if height % 32 or image_width % 32 or width < 1:
            raise ValueError(
                f"VGG11 needs inputs whose sides are multiples of 32 (five 2x2 pools), got {height}x{image_width}"
            )
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG11_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, item * width, kernel_size=3, padding=1), nn.ReLU()]
                channels = item * width
        self.features = nn.Sequential(*layers)
        flat = channels * (height // 32) * (image_width // 32)
        hidden = 8 * width
        self.classifier = nn.Sequential(
            nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(inputs).flatten(1))


def vgg11(num_classes: int, in_channels: int = 3, image_size: int | tuple[int, int] = 32, width: int = 64) -> VGG11:
    """VGG-11 without batch normalisation with a CIFAR-sized head (:class:`VGG11`)."""
    return VGG11(num_classes, in_channels=in_channels, image_size=image_size, width=width)


MODEL_NAMES = ("mlr", "mlp", "cnn", "femnist_cnn", "lstm", "gru", "resnet18_gn", "resnet18_bn", "vgg11", "quadratic")


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    hidden: tuple[int, ...] = (200, 200),
    *,
    rnn_hidden: int | None = None,
    rnn_layers: int = 2,
    embedding_dim: int = 8,
    vocab_size: int | None = None,
    groups: int = 2,
    resnet_stem: str = "cifar",
    width: int = 64,
) -> nn.Module:
    """Build a registered model by name for inputs of ``input_shape`` (without the batch dimension).

    The Python face of the registry: the keyword arguments that are keys of the model's ``[model]`` section
    fill it, and the entry's build makes the module (the zoo's builds are below, one per model).

    Args:
        name: a registered model (the zoo: :data:`MODEL_NAMES`, table in the module docstring).
        input_shape: one example's shape: ``(C, H, W)`` for images (``cnn``,
            ``resnet18_gn``, ``resnet18_bn``, ``vgg11``; ``femnist_cnn`` also takes a flat
            ``(784,)``), ``(T,)`` character ids for ``lstm``/``gru``, anything for ``mlr``/``mlp``.
        num_classes: output size.
        hidden: ``mlp`` hidden widths: ``(200, 200)`` for MNIST, ``(100, 100)`` for EMNIST-L.
        rnn_hidden: ``lstm``/``gru`` width; default 100 for ``lstm`` (FedDyn; FedProx: 256) and 256 for ``gru``.
        rnn_layers: stacked recurrent layers (2).
        embedding_dim: character embedding size (8).
        vocab_size: character ids for ``lstm``/``gru``; defaults to ``num_classes``
            (next-character prediction over the same vocabulary).
        groups: GroupNorm groups of ``resnet18_gn`` (2).
        resnet_stem: ``"cifar"`` (3x3, no max-pool) or ``"imagenet"`` (FedDyn's torchvision layout), for
            ``resnet18_gn`` and ``resnet18_bn``.
        width: base channel count of ``resnet18_gn``, ``resnet18_bn`` and ``vgg11`` (64; smaller for tests).
    """
    entry = registry.lookup(name)
    if entry is None:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(registry.names())}")
    given = {
        "hidden": tuple(hidden),
        "rnn_hidden": rnn_hidden,
        "rnn_layers": rnn_layers,
        "embedding_dim": embedding_dim,
        "groups": groups,
        "resnet_stem": resnet_stem,
        "width": width,
    }
    # Not validated, as the modules check their own arguments (the config validated a run's section already).
    section = entry.config_type.model_construct(
        **{key: value for key, value in given.items() if key in entry.config_type.model_fields}
    )
    return entry.build(section, tuple(int(size) for size in input_shape), num_classes, vocab_size)


def _in_features(input_shape: tuple[int, ...]) -> int:
    return math.prod(input_shape)


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"model {name} needs image inputs of shape (channels, height, width); got {input_shape}")
    return input_shape  # type: ignore[return-value]


def femnist_cnn_module(input_shape: tuple[int, ...], num_classes: int, padding: int = 0) -> FemnistCNN:
    """The FEMNIST CNN for ``(C, H, W)`` images or flat square ones like ``(784,)``."""
    if len(input_shape) == 3:
        channels, height, image_width = input_shape
    elif len(input_shape) == 1 and math.isqrt(input_shape[0]) ** 2 == input_shape[0]:
        channels, height, image_width = 1, math.isqrt(input_shape[0]), math.isqrt(input_shape[0])
    else:
        raise ValueError(
            f"model femnist_cnn needs (channels, height, width) or flat square images like (784,); got {input_shape}"
        )
    return FemnistCNN(num_classes, in_channels=channels, image_size=(height, image_width), padding=padding)


# ---------------------------------------------------------------- [model] sections and builds of the registry entries
# Each model's own keys, with the defaults the flat [model] section had (so configs keep their fingerprints);
# driftlab.models registers each with its build and batched forward.


class MLRConfig(ModelSection):
    name: Literal["mlr"] = "mlr"


class MLPConfig(ModelSection):
    name: Literal["mlp"] = "mlp"
    hidden: tuple[Width, ...] = Field(
        (200, 200),
        max_length=64,
        description="hidden widths of the mlp (784-200-200-10 by default; (100, 100) for EMNIST-L)",
    )


class CNNConfig(ModelSection):
    name: Literal["cnn"] = "cnn"


class FemnistCNNConfig(ModelSection):
    name: Literal["femnist_cnn"] = "femnist_cnn"


class _RNNConfig(ModelSection):
    rnn_hidden: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="lstm/gru hidden units; none = 100 for lstm (FedDyn), 256 for gru"
    )
    rnn_layers: int = Field(2, ge=1, le=64, description="lstm/gru layers")
    embedding_dim: int = Field(8, ge=1, le=MAX_WIDTH, description="lstm/gru character embedding size")


class LSTMConfig(_RNNConfig):
    name: Literal["lstm"] = "lstm"


class GRUConfig(_RNNConfig):
    name: Literal["gru"] = "gru"


class ResNet18GNConfig(ModelSection):
    name: Literal["resnet18_gn"] = "resnet18_gn"
    groups: int = Field(2, ge=1, le=MAX_WIDTH, description="resnet18_gn: GroupNorm groups")
    resnet_stem: Literal["cifar", "imagenet"] = Field(
        "cifar", description="resnet18_gn stem: cifar (3x3, no max-pool) or imagenet (FedDyn's code)"
    )
    width: int = Field(64, ge=1, le=MAX_WIDTH, description="resnet18_gn/vgg11 base width")


class ResNet18BNConfig(ModelSection):
    name: Literal["resnet18_bn"] = "resnet18_bn"
    resnet_stem: Literal["cifar", "imagenet"] = Field(
        "cifar", description="resnet18_bn stem: cifar (3x3, no max-pool) or imagenet (torchvision's)"
    )
    width: int = Field(64, ge=1, le=MAX_WIDTH, description="resnet18_bn base width")


class VGG11Config(ModelSection):
    name: Literal["vgg11"] = "vgg11"
    width: int = Field(64, ge=1, le=MAX_WIDTH, description="resnet18_gn/vgg11 base width")


class QuadraticConfig(ModelSection):
    name: Literal["quadratic"] = "quadratic"
    start: float | None = Field(
        None, allow_inf_nan=False, description="every coordinate of x starts here (the decaying-K paper: 0.4); unset: 0"
    )


# Each zoo model's build: (its [model] section, one example's input shape, classes, vocabulary) -> the module.


def build_mlr(
    section: MLRConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    return MultinomialLogisticRegression(_in_features(input_shape), num_classes)


def build_mlp(
    section: MLPConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    return MLP(_in_features(input_shape), tuple(section.hidden), num_classes)


def build_cnn(
    section: CNNConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    channels, height, image_width = _image_shape("cnn", input_shape)
    return FedDynCNN(num_classes, in_channels=channels, image_size=(height, image_width))


def build_femnist_cnn(
    section: FemnistCNNConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    return femnist_cnn_module(input_shape, num_classes)


def build_char_rnn(
    section: _RNNConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(
            f"model {section.name} needs sequences of character ids, inputs of shape (length,); got {input_shape}"
        )
    model_class = CharLSTM if section.name == "lstm" else CharGRU
    return model_class(
        vocab_size=vocab_size or num_classes,
        embedding_dim=section.embedding_dim,
        hidden=section.rnn_hidden,  # None: the class's default_hidden
        layers=section.rnn_layers,
        num_classes=num_classes,
    )


def build_resnet18_gn(
    section: ResNet18GNConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    channels, _, _ = _image_shape("resnet18_gn", input_shape)
    return resnet18_groupnorm(
        num_classes, groups=section.groups, in_channels=channels, stem=section.resnet_stem, width=section.width
    )


def build_resnet18_bn(
    section: ResNet18BNConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    channels, _, _ = _image_shape("resnet18_bn", input_shape)
    return resnet18_batchnorm(num_classes, in_channels=channels, stem=section.resnet_stem, width=section.width)


def build_vgg11(
    section: VGG11Config, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    channels, height, image_width = _image_shape("vgg11", input_shape)
    return vgg11(num_classes, in_channels=channels, image_size=(height, image_width), width=section.width)


def build_quadratic(
    section: QuadraticConfig, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    from driftlab.data.quadratic import QuadraticObjective

    if len(input_shape) != 1 or input_shape[0] % 2:
        raise ValueError(f"model quadratic needs quadratic data (rows [a, b]); got inputs of shape {input_shape}")
    return QuadraticObjective(input_shape[0] // 2, start=section.start or 0.0)
