"""Packed checkpoints: export, load back, verify."""
