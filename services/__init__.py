"""jetrl services. Each is `python -m services.<name>` and `jetrl <name>`."""
