"""A thin client for the ledger PostgreSQL extension: every rule stays in the extension's SQL."""
