"""Process groups and collectives of sequence parallelism."""
