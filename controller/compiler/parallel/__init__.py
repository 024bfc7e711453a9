"""Passes that shard a stage across a tensor-parallel group (tensor.py, sequence.py)."""
