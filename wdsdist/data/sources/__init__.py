"""Reading shards from wherever they are: shard specs and indexes (shardspec, index), the one
switch between local files, http(s), s3:// and gs:// and pipe: (opener, over httpopen and
s3open), and spans of a shard from an index's byte offsets (spanread). Imports the tar parser
(tar/) and nothing else of the loader."""
