"""Adapters of agent frameworks onto the ledger, one module per framework (each imports its framework; the core client imports none)."""
