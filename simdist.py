#!/usr/bin/env python3
"""Simulate size ranks x nworkers DataLoader workers: does every rank get the same number of batches?
(wds-simdist once installed)

Real mode (default) runs the training loader for each simulated rank over real shards; --plan
gives the same report from sample counts alone. Exit status: 0 SUCCESS, 1 FAILED, 2 bad input.

simdist.py                                  # 10 shards x 100 samples, 3 ranks x 3 workers: FAILED
simdist.py --nbatches 30                    # cut every rank to 30 batches: SUCCESS
simdist.py --nbatches 40 --dsrepeat 2       # more batches than short ranks hold: repeat inside workers
simdist.py --nbatches auto --showsplits --plot outputs/simdist.png
simdist.py --split samples                  # equal spans of samples: SUCCESS, 20 samples padded (--remainder drop)
simdist.py --plan --split samples --resize-at 13 --to-size 2 --to-nworkers 1   # an elastic resume mid-epoch
simdist.py --shards data/shards/imagenet-train.index.json --size 16 --nworkers 8 --batch-size 256
simdist.py --plan --nshards 100000 --samples-per-shard 1000+-50 --size 1024 --nworkers 8 --batch-size 64
simdist.py --plan --split samples --nshards 1281 --size 256 --node-ranks 8 --nepochs 3 \
    --shard-bytes 100MB --cache-size 200GB --shard-order node   # what the store sends each node, per epoch
simdist.py --plan --mix imagenet:1281167/1281 photos:128000/128:weight=0.2 --epoch-samples 1500000 \
    --size 256 --nworkers 8 --batch-size 256 --nepochs 3      # several data sets: per source and rank
"""

from wdsdist.simdist.cli import run

if __name__ == "__main__":
    run()
