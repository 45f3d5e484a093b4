"""Where the model runs: the work/stream/event protocol, its backends, the executor."""
