//! The key rule against real names: every line of `data/key_corpus.txt` says whether the value
//! under that name is redacted by default.

use ledger_model::redaction::{is_sensitive_key, Rules};

#[test]
fn every_corpus_name_is_read_as_marked() {
    let rules = Rules::default();
    let mut names = 0;
    let mut wrong = Vec::new();
    for (n, line) in include_str!("data/key_corpus.txt").lines().enumerate() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (mark, name) = line
            .split_once('\t')
            .unwrap_or_else(|| panic!("line {}: no tab in {line:?}", n + 1));
        let secret = match mark {
            "secret" => true,
            "plain" => false,
            _ => panic!("line {}: {mark:?} is neither secret nor plain", n + 1),
        };
        names += 1;
        if is_sensitive_key(&rules, name) != secret {
            wrong.push(format!("line {}: {mark}\t{name}", n + 1));
        }
    }
    assert!(names >= 500, "{names} names");
    assert!(wrong.is_empty(), "read otherwise:\n{}", wrong.join("\n"));
}
