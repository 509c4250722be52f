"""The Flower peer: FedAvg with ``flwr`` on the same model, data partition and settings as
an aiopipe run, for epoch times side by side (bench/shaped.py runs it).

Runs only in the Flower virtual environment that bench/shaped.py creates
(``bench/.flower-venv``: flwr, torch, and the few libraries importing aiopipe needs;
flwr is never a dependency of aiopipe), with the repository on PYTHONPATH.

Both sides read one aiopipe ``config.toml`` and use aiopipe's own pieces, so the model's
initial weights (`build_model`, seeded), each device's shard (`device_indices`), the
per-epoch shuffle (`epoch_order`), SGD with the same learning rate and momentum, the batch
size, the test set and the device slowdown emulation (each step takes ``s x`` its CPU
time, the rest a sleep, as aiopipe's compute resource does) are the same as in aiopipe's
FL mode.

A round is one epoch: every client trains one pass over its shard, then FedAvg weighted by
samples. The round time is taken on the server from the moment all clients are sampled
(configure_fit returned) to the end of aggregate_fit: parameter download, local training,
upload and averaging, like aiopipe's epoch time; the central evaluation is outside it.

    PYTHONPATH=. bench/.flower-venv/bin/python bench/flower_peer.py server \
        --address 10.213.0.1:8080 --config run/config.toml --out flower.json
    PYTHONPATH=. bench/.flower-venv/bin/python bench/flower_peer.py client \
        --server 10.213.0.1:8080 --config run/config.toml --device-id 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from aiopipe.config import RunConfig
from aiopipe.data import epoch_order, open_dataset
from aiopipe.runtime.plan import build_model, device_indices, train_dataset


def _arrays(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def _load(model: nn.Module, arrays: list[np.ndarray]) -> None:
    state = model.state_dict()
    if len(arrays) != len(state):
        raise ValueError(f"expected {len(state)} arrays, got {len(arrays)}")
    model.load_state_dict(
        {
            k: torch.from_numpy(np.asarray(a)).to(v.dtype)
            for (k, v), a in zip(state.items(), arrays, strict=True)
        }
    )


def _model(config: RunConfig) -> tuple[nn.Sequential, Any]:
    train = train_dataset(config)
    return build_model(config, num_classes=train.num_classes, in_shape=train.in_shape), train


def serve(address: str, config: RunConfig, out: Path, round_timeout: float) -> None:
    """Run the Flower server for ``config.epochs`` rounds; write per-round figures."""
    import flwr
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig, start_server
    from flwr.server.strategy import FedAvg

    model, _ = _model(config)
    test = open_dataset(config.dataset, split="test", size=config.test_samples, seed=config.seed)
    started: dict[int, float] = {}
    ended: dict[int, float] = {}
    accuracy: dict[int, float] = {}
    fit_metrics: dict[int, dict[str, float]] = {}

    def evaluate(
        server_round: int, arrays: list[np.ndarray], _cfg: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        _load(model, arrays)
        model.eval()
        correct, loss_sum = 0, 0.0
        with torch.no_grad():
            for first in range(0, len(test), 500):
                x, y = test.batch(range(first, min(first + 500, len(test))))
                logits = model(x)
                correct += int((logits.argmax(1) == y).sum())
                loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        model.train()
        accuracy[server_round] = correct / max(1, len(test))
        return loss_sum / max(1, len(test)), {"accuracy": accuracy[server_round]}

    def average(metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        n = sum(k for k, _ in metrics)
        return {
            "loss": sum(m["loss_sum"] for _, m in metrics) / max(1, n),
            "train_accuracy": sum(m["correct"] for _, m in metrics) / max(1, n),
            "samples": n,
            # each client's seconds in its training loop (the round's compute), their mean
            "train_s": sum(m["train_s"] for _, m in metrics) / max(1, len(metrics)),
        }

    class TimedFedAvg(FedAvg):  # type: ignore[misc]
        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            instructions = super().configure_fit(server_round, parameters, client_manager)
            started[server_round] = time.perf_counter()  # after every client is sampled
            return instructions

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            if failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} clients failed")
            aggregated = super().aggregate_fit(server_round, results, failures)
            ended[server_round] = time.perf_counter()
            fit_metrics[server_round] = aggregated[1]
            return aggregated

    k = config.devices
    strategy = TimedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=k,
        min_evaluate_clients=0,
        min_available_clients=k,
        evaluate_fn=evaluate,
        accept_failures=False,
        on_fit_config_fn=lambda r: {"epoch": r - 1},
        initial_parameters=ndarrays_to_parameters(_arrays(model)),
        fit_metrics_aggregation_fn=average,
    )
    start_server(
        server_address=address,
        strategy=strategy,
        config=ServerConfig(num_rounds=config.epochs, round_timeout=round_timeout),
    )
    rounds = [
        {
            "epoch": r - 1,
            "time_s": ended[r] - started[r],
            "accuracy": accuracy.get(r),
            **fit_metrics.get(r, {}),
        }
        for r in sorted(ended)
    ]
    out.write_text(
        json.dumps(
            {
                "flwr": flwr.__version__,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "rounds": rounds,
            },
            indent=1,
        )
    )
    times = ", ".join(f"{r['time_s']:.2f}" for r in rounds)
    print(f"flower server: {len(rounds)} rounds; times {times} s", flush=True)


def client(server: str, config: RunConfig, device_id: int) -> None:
    """Run one Flower client holding device ``device_id``'s shard."""
    from flwr.client import NumPyClient, start_client

    model, train = _model(config)
    indices = device_indices(config, train, device_id)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.learning_rate, momentum=config.momentum
    )
    slowdown = config.device_slowdown_of(device_id)
    batch = config.batch_size

    class Peer(NumPyClient):  # type: ignore[misc]
        def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
            return _arrays(model)

        def fit(
            self, parameters: list[np.ndarray], cfg: dict[str, Any]
        ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            _load(model, parameters)
            order = epoch_order(indices, epoch=int(cfg["epoch"]), seed=config.seed)
            samples, loss_sum, correct = 0, 0.0, 0
            began = time.perf_counter()
            for it in range(len(order) // batch):
                start, start_cpu = time.perf_counter(), time.thread_time()
                x, y = train.batch(order[it * batch : (it + 1) * batch])
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                samples += len(y)
                loss_sum += float(loss.detach()) * len(y)
                correct += int((logits.argmax(1) == y).sum())
                if slowdown > 1.0:  # the same emulation as aiopipe's compute resource
                    due = slowdown * (time.thread_time() - start_cpu)
                    time.sleep(max(0.0, due - (time.perf_counter() - start)))
            return _arrays(model), samples, {"loss_sum": loss_sum, "correct": correct,
                                             "train_s": time.perf_counter() - began}

    start_client(
        server_address=server, client=Peer().to_client(), insecure=True, max_wait_time=120.0
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--address", required=True)
    s.add_argument("--config", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--round-timeout", type=float, default=900.0)
    c = sub.add_parser("client")
    c.add_argument("--server", required=True)
    c.add_argument("--config", type=Path, required=True)
    c.add_argument("--device-id", type=int, required=True)
    args = parser.parse_args()
    config = RunConfig.from_toml(args.config)
    torch.set_num_threads(config.torch_threads)
    if args.role == "server":
        serve(args.address, config, args.out, args.round_timeout)
    else:
        client(args.server, config, args.device_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
