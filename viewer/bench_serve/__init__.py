"""`mstrace bench-serve`: a load generator in the style of `vllm bench serve`."""
