"""Tools around the loader: shard writing, the synthetic data set, output folders."""
