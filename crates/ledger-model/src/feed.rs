//! The pure part of writing a run's events together: seq allocation and the INSERT's text.

/// Gives the events without a seq (`None`) the seqs `last - n + 1 ..= last`, in order, where
/// `last` is the run's `last_seq` after it was moved on by their count `n`.
pub fn allocate<'a>(seqs: impl Iterator<Item = &'a mut Option<i64>>, last: i64) {
    let missing: Vec<&mut Option<i64>> = seqs.filter(|s| s.is_none()).collect();
    let first = last - missing.len() as i64 + 1;
    for (seq, slot) in (first..).zip(missing) {
        *slot = Some(seq);
    }
}

/// `INSERT ... VALUES` of `n` events and, with `notify`, their `n` notifications in seq order:
/// $1..$4 are the tenant, workspace, run and channel, then six parameters per event (id, seq,
/// event type, step, payload, note). Without `notify`, the channel and the notes are not used. A
/// `VALUES` list keeps a cheap generic plan; an `unnest` of arrays did not.
pub fn insert_statement(n: usize, notify: bool) -> String {
    let p = |i: usize, k: usize| 5 + 6 * i + k;
    let rows: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "($1, $2, ${}, $3, ${}, ${}, ${}, ${})",
                p(i, 0),
                p(i, 1),
                p(i, 2),
                p(i, 3),
                p(i, 4)
            )
        })
        .collect();
    let insert = format!(
        "INSERT INTO ledger.run_events \
             (tenant_id, workspace_id, id, run_id, seq, event_type, step_id, payload) \
         VALUES {}",
        rows.join(", ")
    );
    if !notify {
        return insert;
    }
    let notes: Vec<String> = (0..n)
        .map(|i| format!("pg_catalog.pg_notify($4, ${})", p(i, 5)))
        .collect();
    format!("WITH e AS ({insert}) SELECT {}", notes.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_seqs_follow_the_allocated_ones_in_order() {
        let mut seqs = [Some(5), None, None];
        allocate(seqs.iter_mut(), 7);
        assert_eq!(seqs, [Some(5), Some(6), Some(7)]);
        let mut none: [Option<i64>; 0] = [];
        allocate(none.iter_mut(), 3);
        let mut all = [None, None];
        allocate(all.iter_mut(), 2);
        assert_eq!(all, [Some(1), Some(2)]);
    }

    #[test]
    fn each_event_has_its_row_and_its_notification_in_order() {
        let one = insert_statement(1, true);
        assert!(one.contains("VALUES ($1, $2, $5, $3, $6, $7, $8, $9))"));
        assert!(one.ends_with("SELECT pg_catalog.pg_notify($4, $10)"));
        let two = insert_statement(2, true);
        assert!(two
            .contains("($1, $2, $5, $3, $6, $7, $8, $9), ($1, $2, $11, $3, $12, $13, $14, $15))"));
        assert!(two.ends_with("pg_catalog.pg_notify($4, $10), pg_catalog.pg_notify($4, $16)"));
    }

    #[test]
    fn without_notifications_the_rows_are_the_same() {
        let quiet = insert_statement(2, false);
        assert!(!quiet.contains("pg_notify") && !quiet.contains("$4") && !quiet.contains("$10"));
        assert!(insert_statement(2, true).contains(&quiet));
    }
}
