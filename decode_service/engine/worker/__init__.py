"""Data plane: KV pools and conv slots (tensors), snapshots, runner, CUDA graphs, sampler, Redis prefix I/O.

It executes the control plane's `SchedulerOutput` and never decides what runs."""
