"""The runtime: the engine, the arm runner, the running peers, what the commands do, preflight,
paired comparison and diagnostics."""
