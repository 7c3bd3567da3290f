"""Command-line tools beside training (benchmarks, planners, export, generation)."""
