"""Shared test settings: one torch thread so tests do not fight over the two cores."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
