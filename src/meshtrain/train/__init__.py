"""Training: the loop, optimizer and schedules, checkpoints, metrics (timers, throughput, MFU) and their sinks."""
