"""Training: the config schema, the one reader of torchrun's environment, the loop, fault handling."""
