"""Who reads what, as pure functions of counts and seeds, with no I/O: shards and sample spans to
ranks and workers (splits), the epoch's orders (order), where a checkpoint left each worker
(resume), and the re-split on another world size (elastic)."""
