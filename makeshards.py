#!/usr/bin/env python3
"""Write WebDataset shards plus an index of sample counts (wds-makeshards once installed).

makeshards.py --source /data/imagenet/train --shards /data/shards --prefix imagenet-train
makeshards.py --synthetic 2000 --shards data/synth --prefix synth-train
makeshards.py --synthetic 500 --split val --shards data/synth --prefix synth-val
makeshards.py --index 'data/other-{000000..000009}.tar'
makeshards.py --index 's3://bucket/train/shard-{000000..000099}.tar' --output s3://bucket/train/train.index.json
"""

from wdsdist.tools.makeshards import run

if __name__ == "__main__":
    run()
