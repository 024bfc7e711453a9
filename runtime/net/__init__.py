"""gRPC plumbing shared by both daemons and the client: calls with deadlines, servers with the token
check, TLS, chunked calls, relayed dispatch, addresses and log setup. No torch."""
