"""One-off studies behind design decisions; each runs as ``python -m benchmarks.studies.NAME``."""
