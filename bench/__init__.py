"""Benchmarks: what this project costs and gives, measured, by purpose; each folder says what it measures.
Every dated report under results/ names the command that made it."""
