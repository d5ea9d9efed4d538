"""Capacity planning: a calibrated step cost model, the estimate and simulate commands, SLO admission."""
