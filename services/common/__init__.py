"""What every service shares: settings, logging, the bus, the supervised runner, metrics."""
