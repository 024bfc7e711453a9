"""The user's side: Client, Job and futures, Program, remote values, export, LocalCluster and typed
views of plans, status and timelines. The public names are re-exported by ``atoll`` itself."""
