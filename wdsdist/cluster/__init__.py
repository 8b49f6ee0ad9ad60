"""Torchrun's environment read once, the faults code (signals, watchdog, a rank's loss) and the
launcher: what training and prediction both run under."""
