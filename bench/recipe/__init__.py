"""What the recipe's tools cost and what they do: each augmentation op, the loader with a policy,
torch.compile, the digits' accuracy by seed (./run recipe.py); decode=gpu's ops against the CPU
path's pixels (./run gpuaugment.py)."""
