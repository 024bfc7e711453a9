"""Parameter-server programs on a worker: server shards (shard.py), task steps (task.py), the
gRPC service both answer through (service.py)."""
