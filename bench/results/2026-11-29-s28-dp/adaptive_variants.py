"""Adaptive clipping's clip norm, round by round, on bench/dp_accounting.py's central
fleet at z = 1 with two other settings than the bench's (gamma 0.5, eta_C 0.2): a
slower clip learning rate, and a low target quantile. Not part of the bench: an
exploration of why its adaptive row fails (README.md).

    PYTHONPATH=. .venv/bin/python bench/results/2026-11-29-s28-dp/adaptive_variants.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/

import dp_accounting as bench

from aiopipe.strategies.central_dp import DpFedAvg

VARIANTS = ({"target_quantile": 0.5, "clip_learning_rate": 0.2},
            {"target_quantile": 0.5, "clip_learning_rate": 0.05},
            {"target_quantile": 0.1, "clip_learning_rate": 0.2})


async def main() -> None:
    args = bench.parse([])
    installed = DpFedAvg.installed
    for variant in VARIANTS:
        clips: list[float] = []

        def keep(self: DpFedAvg, clips: list[float] = clips) -> None:
            installed(self)
            clips.append(round(self.clip, 3))

        DpFedAvg.installed = keep  # type: ignore[method-assign]
        config = bench.central_config(args, 1.0, "adaptive")
        given: dict[str, Any] = dict(config.options.aggregation_options)
        config = config.replace(options={"aggregation_options": {**given, **variant}})
        row = await bench.measure("central", str(variant), config)
        DpFedAvg.installed = installed  # type: ignore[method-assign]
        print(f"{variant}: accuracy {row['accuracy']:.3f}, epsilon {row['epsilon']:.3g}, "
              f"clip after rounds 1, 6, 11, ..., 26: {clips[::5]}, after 30: {clips[-1]}")


if __name__ == "__main__":
    asyncio.run(main())
