"""The cluster the controller keeps: registry, placement, admission, fairness, leases, rendezvous,
dispatch and metrics."""
