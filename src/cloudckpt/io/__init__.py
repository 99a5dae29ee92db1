"""Moving bytes: the I/O scheduler, ranged reads, the multipart sink, buffer pools, progress."""
