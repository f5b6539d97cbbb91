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
    resnet18_groupnorm,
    vgg11,
)

_IMAGES = ("images",)
for _entry in (
    ModelEntry(
        "mlr",
        zoo.MLRConfig,
        zoo.build_mlr,
        description="multinomial logistic regression (FedProx)",
        batched_forward=batched.mlp,
        module_types=(zoo.MultinomialLogisticRegression,),
    ),
    ModelEntry(
        "mlp",
        zoo.MLPConfig,
        zoo.build_mlp,
        description="ReLU MLP, 784-200-200-10 by default (FedDyn)",
        batched_forward=batched.mlp,
        module_types=(zoo.MLP,),
    ),
    ModelEntry(
        "cnn",
        zoo.CNNConfig,
        zoo.build_cnn,
        _IMAGES,
        "FedDyn CIFAR CNN",
        batched_forward=batched.feddyn_cnn,
        module_types=(zoo.FedDynCNN,),
    ),
    ModelEntry(
        "femnist_cnn",
        zoo.FemnistCNNConfig,
        zoo.build_femnist_cnn,
        ("images", "square_vectors"),
        "decaying-K FEMNIST CNN",
        batched_forward=batched.femnist_cnn,
        module_types=(zoo.FemnistCNN,),
    ),
    ModelEntry(
        "lstm",
        zoo.LSTMConfig,
        zoo.build_char_rnn,
        ("sequences",),
        "next-character LSTM (FedDyn, FedProx)",
        batched_forward=batched.char_rnn,
        module_types=(zoo.CharLSTM,),
    ),
    ModelEntry(
        "gru",
        zoo.GRUConfig,
        zoo.build_char_rnn,
        ("sequences",),
        "next-character GRU (decaying-K)",
        batched_forward=batched.char_rnn,
        module_types=(zoo.CharGRU,),
    ),
    ModelEntry(
        "resnet18_gn",
        zoo.ResNet18GNConfig,
        zoo.build_resnet18_gn,
        _IMAGES,
        "ResNet-18 with GroupNorm (FedDyn appendix)",
        batched_forward=batched.resnet,
        module_types=(zoo.ResNet18GN,),
    ),
    ModelEntry(
        "vgg11",
        zoo.VGG11Config,
        zoo.build_vgg11,
        _IMAGES,
        "VGG-11 without batch normalisation (EFL)",
        batched_forward=batched.vgg,
        module_types=(zoo.VGG11,),
    ),
    ModelEntry(
        "quadratic",
        zoo.QuadraticConfig,
        zoo.build_quadratic,
        ("objectives",),
        "the parameter x of the quadratic clients (data.name = quadratic or quadratic1d)",
    ),
):
    register(_entry)
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
    "resnet18_groupnorm",
    "vgg11",
]
