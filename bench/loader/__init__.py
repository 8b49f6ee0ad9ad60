"""The loader against its peers (Streaming, LitData, wids, DALI, FFCV, SPDL, the WebDataset README's
pipeline, ImageFolder) and against another commit: samples/s, CPU, memory; conversion to shards,
mixing, and PyTorch Lightning's cost (./run bench.py, mix.py, lightning.py)."""
