"""Runs: each experiment as a config and a `run(config) -> Result` whose result saves and loads."""
