"""Training: the typed config, the loop and its recipe, evaluation, checkpoints and the report."""
