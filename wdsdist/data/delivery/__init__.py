"""The running loader: one rank's DataLoader over its workers (pipeline), the stream inside each
worker (stream), batches and the shared memory they travel in (batches, sharedbatches), the first
batch on every core (warmstart), and the workers' own setup (workers). It uses every other part."""
