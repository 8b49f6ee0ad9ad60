"""One property of reading data at a time: starting mid-shard, a far store, a node cache's egress
against simdist's plan, downscaled region decode, damaged data (./run spans.py, remote.py, egress.py,
downscale.py, damaged.py)."""
