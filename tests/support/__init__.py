"""What the test modules share and that is not a test: the CLI as a user runs it, checkpoints,
synthetic traces, stand-ins (CUDA, an OTLP collector), oracles. tests/conftest.py builds the
session's shared fixtures from these."""
