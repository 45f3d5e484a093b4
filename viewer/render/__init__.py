"""The front ends' drawing: each function takes a typed result of viewer/analysis and draws it."""
