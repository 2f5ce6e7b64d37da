"""What every trainer needs under sequence parallelism: placement and sharding, checks, the
step loop, gradient norm, saving and resuming, logs, fault handling."""
