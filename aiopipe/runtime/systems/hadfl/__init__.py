"""HADFL (`../shared/papers/hadfl.txt`): decentralized asynchronous federated learning
on heterogeneous devices, §III; the coordinator's components §III-A, the mutual
negotiation §III-B, partial synchronisation over a ring §III-C.

- coordinator half: `coordinator.HADFL` (strategy, rings, the model's backup);
- device half: `device.HADFLDevice` (local steps, then the ring's average:
  `partial_sync`, over the ring all-reduce of `gossip`; a lost peer bypassed).
"""
