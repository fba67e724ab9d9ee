"""Control plane: requests, scheduler, page and conv-slot ids, prefix index. No torch, no device, no Redis.

Its product is `outputs.SchedulerOutput`, plain data that the data plane (`engine/worker/`) executes."""
