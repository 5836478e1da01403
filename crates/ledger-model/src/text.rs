//! Bounded text: summaries and messages are cut to a number of characters, never inside one.

/// The longest summary or error message the ledger stores, in characters.
pub const SUMMARY_CHARS: usize = 8192;

/// `s` cut to at most `max` characters, on a character boundary.
pub fn truncate_chars(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((byte, _)) => &s[..byte],
        None => s,
    }
}

pub fn summary(s: &str) -> String {
    truncate_chars(s, SUMMARY_CHARS).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_cut_at_8192_characters() {
        for n in [0, 1, 8191, 8192] {
            assert_eq!(summary(&"a".repeat(n)).chars().count(), n);
        }
        assert_eq!(summary(&"a".repeat(8193)).chars().count(), 8192);
        assert_eq!(summary(&"a".repeat(100_000)).len(), 8192);
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        // 'é' is 2 bytes, '🦀' is 4: a byte cut would land inside one.
        let s = "é".repeat(9000);
        let cut = summary(&s);
        assert_eq!(cut.chars().count(), 8192);
        assert_eq!(cut.len(), 8192 * 2);
        let s = format!("{}{}", "a".repeat(8191), "🦀🦀");
        let cut = summary(&s);
        assert_eq!(cut.chars().count(), 8192);
        assert!(cut.ends_with('🦀'));
    }
}
