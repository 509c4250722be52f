"""Device-side train hooks ([Note: train hooks] in aiopipe.runtime.stage): FedProx's
proximal term.

FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Eq. 2)
has each device minimise h(w) = F(w) + mu/2 ||w - w_global||^2, w_global the round's
global model. The term's gradient is mu (w - w_global), so `ProximalHook` adds it to
every trainable parameter's accumulated gradient before the step (`before_step`): the
step is the optimizer's step on h, on every stage of the device's model (a split
model's stage before the last never sees the loss, but does see its gradients), and on
the coordinator's replica of the server half (the whole M_k = M^s_k (+) M^c_k is pulled
to the round's global model).
"""

from __future__ import annotations

import torch

from aiopipe.errors import ConfigError
from aiopipe.runtime.stage import StageWork

__all__ = ["ProximalHook"]


class ProximalHook:
    """FedProx's proximal term (module docstring) with ``mu``: the round's
    ``proximal_mu`` setting when the strategy sends one (`FedProx`), else this one.

    Raises:
        ConfigError: ``mu`` is not a finite number >= 0.
    """

    def __init__(self, mu: float = 0.01) -> None:
        if isinstance(mu, bool) or not isinstance(mu, int | float) or not 0 <= mu < float(
                "inf"):
            raise ConfigError(f"the proximal term's mu must be a finite number >= 0, "
                              f"got {mu!r}")
        self.mu = float(mu)

    def loss(self, work: StageWork, loss: torch.Tensor) -> torch.Tensor:
        """The loss as it is (the term goes to the gradients: `before_step`)."""
        return loss

    def before_step(self, work: StageWork) -> None:
        """grad += mu (w - w_global) for every parameter of the round's weights."""
        mu = float(work.round_settings.get("proximal_mu", self.mu))
        if not mu:
            return
        with torch.no_grad():
            for name, parameter in work.module.named_parameters():
                start = work.round_weights.get(name)
                if start is None:
                    continue
                pull = (parameter - start).mul_(mu)
                if parameter.grad is None:
                    parameter.grad = pull
                else:
                    parameter.grad.add_(pull)
