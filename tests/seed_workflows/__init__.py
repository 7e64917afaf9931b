"""Workflows written as the seed documents (AReaL's) write them; only the import lines differ. The
acceptance tests run them in the real stack (tests/integration/test_seed_workflows.py)."""
