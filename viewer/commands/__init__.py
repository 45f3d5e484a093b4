"""The commands that start an engine (`run`, `run --live`, `serve`, the torchrun entry
point) and the flags they share; the analyses and renderers never import from here."""
