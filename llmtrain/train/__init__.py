"""Training: the loop, metrics, loggers and the end-of-run report."""
