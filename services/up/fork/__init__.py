"""`jetrl up`'s fork server: the services forked from one process that imported what they share
(`server.py`, run as `python -m services.up.fork.server`), and `up`'s side of it (`client.py`)."""
