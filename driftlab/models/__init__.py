"""Models: the zoo (plain torch.nn modules), registered as entries of the model registry.

Each zoo model is registered here with its ``[model]`` config type, its build and its batched
forward, through the same ``register`` a plugin calls for a model of its own
(``driftlab.models.registry``; docs/design.md, "A model of your own").
"""

from driftlab.models import batched, zoo
from driftlab.models.registry import REGISTRY as _REGISTRY
from driftlab.models.registry import ModelEntry, ModelSection, register
from driftlab.models.zoo import (
    MLP,
    MODEL_NAMES,
    CharGRU,
    CharLSTM,
    FedDynCNN,
    FemnistCNN,
    MultinomialLogisticRegression,
    build_model,
    resnet18_batchnorm,
    resnet18_groupnorm,
    vgg11,
)

_IMAGES = ("images",)
_ANY = ("vectors", "images")  # ModelEntry's default inputs
# name, config type, build, inputs, description, batched forward, module type (the zoo's order: MODEL_NAMES)
_ZOO = (
    ("mlr", zoo.MLRConfig, zoo.build_mlr, _ANY, "multinomial logistic regression (FedProx)", batched.mlp,
     zoo.MultinomialLogisticRegression),
    ("mlp", zoo.MLPConfig, zoo.build_mlp, _ANY, "ReLU MLP, 784-200-200-10 by default (FedDyn)", batched.mlp, zoo.MLP),
    ("cnn", zoo.CNNConfig, zoo.build_cnn, _IMAGES, "FedDyn CIFAR CNN", batched.feddyn_cnn, zoo.FedDynCNN),
    ("femnist_cnn", zoo.FemnistCNNConfig, zoo.build_femnist_cnn, ("images", "square_vectors"),
     "decaying-K FEMNIST CNN", batched.femnist_cnn, zoo.FemnistCNN),
    ("lstm", zoo.LSTMConfig, zoo.build_char_rnn, ("sequences",), "next-character LSTM (FedDyn, FedProx)",
     batched.char_rnn, zoo.CharLSTM),
    ("gru", zoo.GRUConfig, zoo.build_char_rnn, ("sequences",), "next-character GRU (decaying-K)", batched.char_rnn,
     zoo.CharGRU),
    ("resnet18_gn", zoo.ResNet18GNConfig, zoo.build_resnet18_gn, _IMAGES, "ResNet-18 with GroupNorm (FedDyn appendix)",
     batched.resnet, zoo.ResNet18GN),
    # No batched forward: its BatchNorm layers' running statistics are state (simulation/backends/buffers.py).
    ("resnet18_bn", zoo.ResNet18BNConfig, zoo.build_resnet18_bn, _IMAGES,
     "ResNet-18 with BatchNorm, torchvision's (FedBN; its running statistics are state, averaged like FedAvg's)",
     None, zoo.ResNet18BN),
    ("vgg11", zoo.VGG11Config, zoo.build_vgg11, _IMAGES, "VGG-11 without batch normalisation (EFL)", batched.vgg,
     zoo.VGG11),
    ("quadratic", zoo.QuadraticConfig, zoo.build_quadratic, ("objectives",),
     "the parameter x of the quadratic clients (data.name = quadratic or quadratic1d)", None, None),
)  # fmt: skip
for _name, _config, _build, _inputs, _description, _forward, _module_type in _ZOO:
    register(
        ModelEntry(
            _name,
            _config,
            _build,
            _inputs,
            _description,
            batched_forward=_forward,
            module_types=() if _module_type is None else (_module_type,),
        )
    )
_REGISTRY.finish_built_ins()
assert tuple(_REGISTRY.built_in) == MODEL_NAMES, "the zoo's table (MODEL_NAMES) and its registry entries differ"

__all__ = [
    "MLP",
    "MODEL_NAMES",
    "CharGRU",
    "CharLSTM",
    "FedDynCNN",
    "FemnistCNN",
    "ModelEntry",
    "ModelSection",
    "MultinomialLogisticRegression",
    "build_model",
    "register",
    "resnet18_batchnorm",
    "resnet18_groupnorm",
    "vgg11",
]
