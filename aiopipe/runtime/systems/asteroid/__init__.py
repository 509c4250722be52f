"""Asteroid (`../shared/papers/asteroid.txt`): hybrid pipeline and data parallelism,
§3.2; planned under memory budgets by its Algorithms 1 and 2 (`aiopipe.scheduler.
asteroid`); replay after a fault from stage backups, §3.4.

- coordinator half: `coordinator.Asteroid` (stages, groups and rows; replays);
- device half: `device.AsteroidDevice` (a group's all-reduce before each step, backups
  to the backup node, a round played again from a backup point).
"""
