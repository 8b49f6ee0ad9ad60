"""The loader: shard specs and URLs, the index, splitting and planning (pure), tar reading,
decoding, the pipeline and its resume state. It imports nothing from ``train`` or ``tools``."""
