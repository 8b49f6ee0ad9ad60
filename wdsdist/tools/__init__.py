"""Tools around the loader: simdist, shard writing, the synthetic data set."""
