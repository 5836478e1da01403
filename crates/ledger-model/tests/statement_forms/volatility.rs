/// Every function the extension's write statements call (and the refused examples of
/// statement_forms.rs), by its unqualified name, with the volatility of its most volatile
/// overload in PostgreSQL's catalog or the extension's schema `ledger` (`pg_proc.provolatile`:
/// 'i' IMMUTABLE, 's' STABLE, 'v' VOLATILE). statement_forms.rs refuses a write that calls a
/// function missing here; the `#[pg_test]` `write_statement_functions_have_their_listed_volatility`
/// compares the list with the server's catalog.
pub const VOLATILITY: &[(&str, char)] = &[
    ("budget_spent", 'i'),
    ("budget_window", 'i'),
    ("clock_timestamp", 'v'),
    ("format", 's'),
    ("max", 'i'),
    ("now", 's'),
    ("random", 'v'),
];
