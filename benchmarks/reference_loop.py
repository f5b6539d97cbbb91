"""The reference row of ``round_speed.py``: FedAvg rounds written the way the FedDyn authors' code trains
(``utils_general.train_model`` and the FedAvg driver).

For each client a fresh model loaded from the server's state dict, a shuffled ``DataLoader`` over a ``Dataset`` built
from the client's numpy arrays, ``torch.optim.SGD``, ``loss.backward()``; the client models are flattened to numpy
and averaged, weighted by their sample counts. (Their loop also clips gradients at norm 10; no row clips here.) On
CUDA the model lives on the GPU and each batch is copied there from the host, as their code does.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import numpy as np
import torch
from machine_info import synchronize


def reference_rounds(
    spec: dict[str, Any], inputs: torch.Tensor, targets: torch.Tensor, new_model: Callable[[], torch.nn.Module]
) -> tuple[list[float], int]:
    """Seconds of each round of the FedDyn-style loop (module docstring) after a warm-up round, and the parameter
    count; ``new_model`` builds the workload's model (on the CPU), as the authors' ``model_func`` does."""
    from torch import nn
    from torch.utils import data as torch_data

    device = torch.device(spec["device"])
    token_inputs = not inputs.is_floating_point()

    class ClientDataset(torch_data.Dataset):  # the FedDyn code's `Dataset`: tensors made from numpy per loader
        def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
            self.x_data = torch.tensor(x).long() if token_inputs else torch.tensor(x).float()
            self.y_data = torch.tensor(y).long()

        def __len__(self) -> int:
            return len(self.x_data)

        def __getitem__(self, index: int):
            return self.x_data[index], self.y_data[index]

    def model_func() -> nn.Module:
        return new_model().to(device)

    def get_mdl_params(model: nn.Module) -> np.ndarray:
        return np.concatenate([p.detach().cpu().numpy().reshape(-1) for p in model.parameters()])

    def set_client_from_params(model: nn.Module, params: np.ndarray) -> None:
        state, offset = copy.deepcopy(dict(model.named_parameters())), 0
        for name, value in state.items():
            count = value.numel()
            state[name].data.copy_(torch.tensor(params[offset : offset + count].reshape(value.shape)).to(device))
            offset += count
        model.load_state_dict(state)

    def batches(loader: torch_data.DataLoader):
        """The FedDyn driver's local work: whole epochs, or a fixed number of steps drawn from reshuffled passes."""
        if spec["local_steps"] is None:
            for _epoch in range(spec["local_epochs"]):
                yield from loader
            return
        done = 0
        while True:
            for batch in loader:
                yield batch
                done += 1
                if done == spec["local_steps"]:
                    return

    torch.manual_seed(0)
    n, clients = spec["samples_per_client"], spec["num_clients"]
    client_x = [inputs[k * n : (k + 1) * n].numpy() for k in range(clients)]
    client_y = [targets[k * n : (k + 1) * n].numpy() for k in range(clients)]
    weights = np.full(clients, float(n))
    avg_model = model_func()
    rng = np.random.default_rng(0)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    seconds = []
    for _ in range(1 + spec["timed_rounds"]):
        synchronize(spec["device"])
        started = time.perf_counter()
        selected = rng.choice(clients, spec["clients_per_round"], replace=False)
        params = []
        for k in selected:
            model = model_func()
            model.load_state_dict(copy.deepcopy(dict(avg_model.named_parameters())))
            loader = torch_data.DataLoader(
                ClientDataset(client_x[k], client_y[k]), batch_size=spec["batch_size"], shuffle=True
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=spec["learning_rate"])
            model.train()
            for batch_x, batch_y in batches(loader):
                batch_x, batch_y = batch_x.to(device), batch_y.to(device)
                loss = loss_fn(model(batch_x), batch_y.reshape(-1).long()) / list(batch_y.size())[0]
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            params.append(get_mdl_params(model))
        stacked = np.stack(params)
        average = np.sum(stacked * weights[selected, None] / np.sum(weights[selected]), axis=0)
        set_client_from_params(avg_model, average)
        synchronize(spec["device"])
        seconds.append(time.perf_counter() - started)
    return seconds[1:], sum(p.numel() for p in avg_model.parameters())
