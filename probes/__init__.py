"""How the engine is observed. Probes never import the engine."""

from probes.clock import now_ns

__all__ = ["now_ns"]
