"""The star systems: fl, sl, sfl and PiPar (`../shared/papers/pipar.txt`: the system
§IV, its planner §IV-B..D; FL, SL and SFL its baselines, §V). Each device trains the
first P units (fl: the whole model) on its own data and the coordinator, the star's
centre, the rest, one replica per device; a round ends with FedAvg.

- coordinator half: `coordinator.Star` (placement, rounds, FedAvg, checkpoints), with
  `planning` (P and N per device, "auto" by the planner), `replan` (plans chosen again
  between rounds) and `replicas` (the server halves' replicas while training);
- device half: `device.StarDevice` (the executor's round; privacy where the data leaves).
"""
