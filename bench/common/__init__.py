"""Shared by the benchmarks, measuring nothing themselves: the machine's name in a report, and the
charts drawn from the reports' tables (./run charts.py)."""
