"""The tar format: samples from a byte stream's 512-byte headers (tarread), and the members whose
bytes are read only when they leave the shuffle buffer (lateread). Knows nothing of URLs, specs
or plans: it parses what it is given."""
