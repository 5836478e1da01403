"""Adapters of the ledger to agent frameworks, one module per framework (each imports its framework;
ledger_client itself imports none)."""
