"""A synchronous pipeline across devices (``mode = "pipeline"``; its 1F1B schedule is
Asteroid §3.2's and GPipe's): stage p on device p, activations and gradients device to
device, a round played again from its start after a fault.

- coordinator half: `coordinator.Pipeline` (placement, partition, replays; the base of
  FTPipeHD's and Asteroid's coordinator halves);
- device half: `device.PipelineDevice` (the executor's round; the stage returned with
  its momentum).
"""
