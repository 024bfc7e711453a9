"""Passes that shard a stage across a tensor-parallel group (tensor/, sequence.py)."""
