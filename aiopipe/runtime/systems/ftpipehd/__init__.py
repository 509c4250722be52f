"""FTPipeHD (`../shared/papers/ftpipehd.txt`): an asynchronous pipeline across
heterogeneous devices, §III-C; its partition planner §III-D; chain and global
replication §III-E; recovery §III-F.

- coordinator half: `coordinator.FTPipeHD` (partition re-planned from measured
  capacities, recovery from the chain's replicas);
- device half: `device.FTPipeHDDevice` (whole batches with stashed, versioned weights:
  `async_weights`; snapshots sent on: `chain`; the first stage's gradient timer).
`chain` and `device.ChainDevice` are shared with Asteroid, whose backups are replicas
too.
"""
