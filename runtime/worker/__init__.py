"""The worker daemon: registration and heartbeat (daemon), its RPCs, the executor that interprets a
plan, and the data-plane transports."""
