"""Training: the loop, optimizer and schedule, metrics, loggers and the end-of-run report."""
