"""Adapters that put the ledger under agent frameworks; each module imports its framework, this package none."""
