"""The zoo's batched forwards: each model's forward pass for a stack of clients, written with ``models.layers``.

A batched forward is ``forward(module, params, inputs) -> outputs``: ``inputs`` are ``[C, B, *example]``
(one row of examples per client), ``params`` the clients' stacked parameters (``layers.Parameters``) and the
outputs ``[C, B, classes]``.  It must compute exactly what ``module(inputs[k])`` computes with client ``k``'s
parameters (``simulation/backends/stacked_test.py`` checks every one against the module, client by client, to 1e-12).
Each is named by its model's registry entry (``ModelEntry.batched_forward``), which the vectorized
backend looks up by the module's exact type (``registry.batched_form``).
"""

from __future__ import annotations

import torch
from torch import nn

from driftlab.models import layers
from driftlab.models.layers import Images, Parameters, Rows
from driftlab.models.zoo import BasicBlockGN, MultinomialLogisticRegression


def basic_block(x: Images, block: BasicBlockGN, params: Parameters, prefix: str) -> Images:
    """``BasicBlockGN``: conv-GN-ReLU-conv-GN, plus the shortcut, ReLU."""
    out = layers.conv(x, block.conv1, params, prefix + "conv1.")
    out = layers.relu(layers.group_norm(out, block.bn1, params, prefix + "bn1."))
    out = layers.group_norm(
        layers.conv(out, block.conv2, params, prefix + "conv2."), block.bn2, params, prefix + "bn2."
    )
    shortcut = x if block.downsample is None else layers.sequential(x, block.downsample, params, prefix + "downsample.")
    return Images(torch.relu(out.tensor + shortcut.tensor), x.clients)


layers.register_block(BasicBlockGN, basic_block)  # a user's Sequential of these blocks is read layer by layer too


def feddyn_cnn(module, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = layers.images(inputs)
    x = layers.max_pool(layers.relu(layers.conv(x, module.conv1, params, "conv1.")), module.pool)
    x = layers.max_pool(layers.relu(layers.conv(x, module.conv2, params, "conv2.")), module.pool)
    x = layers.relu(layers.linear(x, module.fc1, params, "fc1."))
    x = layers.relu(layers.linear(x, module.fc2, params, "fc2."))
    return layers.linear(x, module.fc3, params, "fc3.").tensor


def femnist_cnn(module, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    clients, batch = inputs.shape[:2]
    x = layers.images(inputs.reshape(clients, batch, module.in_channels, *module.image_size))
    x = layers.max_pool(layers.relu(layers.conv(x, module.conv1, params, "conv1.")), module.pool)
    x = layers.max_pool(layers.relu(layers.conv(x, module.conv2, params, "conv2.")), module.pool)
    x = layers.relu(layers.linear(x, module.fc1, params, "fc1."))
    return layers.linear(x, module.fc2, params, "fc2.").tensor


def resnet(module, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = layers.conv(layers.images(inputs), module.conv1, params, "conv1.")
    x = layers.layer(layers.relu(layers.group_norm(x, module.bn1, params, "bn1.")), module.maxpool, params, "maxpool.")
    for index in range(1, 5):
        x = layers.sequential(x, getattr(module, f"layer{index}"), params, f"layer{index}.")
    return layers.linear(layers.mean_pool(x), module.fc, params, "fc.").tensor


def vgg(module, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = layers.sequential(layers.images(inputs), module.features, params, "features.")
    return layers.sequential(x.rows(), module.classifier, params, "classifier.").tensor


def char_rnn(module, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    ids = inputs.long() if inputs.is_floating_point() else inputs
    x = layers.embedding(ids, module.embedding, params, "embedding.")
    layer_function = layers.lstm_layer if type(module.rnn) is nn.LSTM else layers.gru_layer
    for layer in range(module.rnn.num_layers):
        x = layer_function(x, module.rnn, params, layer)
    return layers.linear(Rows(x[:, :, -1, :]), module.fc, params, "fc.").tensor


def mlp(module, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    """``MLP`` and ``MultinomialLogisticRegression``: on each example flattened."""
    rows = Rows(inputs.reshape(inputs.shape[0], inputs.shape[1], -1))
    if type(module) is MultinomialLogisticRegression:
        return layers.linear(rows, module.linear, params, "linear.").tensor
    return layers.sequential(rows, module.layers, params, "layers.").tensor
