//! Property-based tests of the pure modules against hostile input (whatever a caller sends must
//! fail cleanly or succeed, never panic or overflow the stack): JSON parsing and canonical text,
//! redaction and argument summaries, caller ids and text truncation.
//!
//! Every property is bounded by a case count (below) and by modest generated sizes, so the whole
//! file runs in seconds in a debug build. Failures print the shrunk input and are not persisted
//! to files (the tree stays clean; rerun with the printed input to reproduce).

use std::borrow::Cow;
use std::collections::hash_map::DefaultHasher;
use std::fmt::Write;
use std::hash::{Hash, Hasher};

use proptest::prelude::*;
use proptest::sample::{select, Index};
use serde_json::{json, Map, Value};

use ledger_model::error::Code;
use ledger_model::ids::{self, MAX_ID_CHARS};
use ledger_model::json::{self, MAX_DEPTH};
use ledger_model::redaction::{
    self, is_credential, is_sensitive_key, normalize_key, Rules, KEY_BYTES, REDACTED, SUMMARY_BYTES,
};
use ledger_model::text::truncate_chars;

/// Cases per property for small inputs.
const CASES: u32 = 1024;
/// Cases per property whose inputs are large (arguments around 8 KiB, keys of kilobytes).
const LARGE_CASES: u32 = 256;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Characters that stress JSON and key handling: quotes, backslashes, every C0 control, DEL,
/// separators JSON leaves raw, bidi and zero-width marks, astral characters, and anything else.
fn hostile_char() -> impl Strategy<Value = char> + Clone {
    prop_oneof![
        4 => any::<char>(),
        2 => select(vec![
            '"', '\\', '/', '[', ']', '{', '}', ':', ',', '\u{7f}', '\u{2028}', '\u{2029}',
            '\u{200d}', '\u{200f}', '\u{202e}', '\u{feff}', '\u{a0}', 'é', '😀', '\u{10ffff}',
        ]),
        1 => prop::char::range('\0', '\u{1f}'),
    ]
}

/// Strings of `hostile_char`s. Rust strings hold no lone surrogates, exactly like jsonb text.
fn text(chars: std::ops::Range<usize>) -> impl Strategy<Value = String> + Clone {
    prop::collection::vec(hostile_char(), chars).prop_map(String::from_iter)
}

/// Numbers as `jsonb_out` prints them: plain integers and decimals, never an exponent.
fn number() -> impl Strategy<Value = Value> {
    "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,12})?"
        .prop_map(|n| json::parse(&n).expect("a plain number parses"))
}

/// JSON values with keys and strings from the given strategies: depth at most 4 below the root,
/// a few dozen nodes.
fn json_with(
    keys: impl Strategy<Value = String> + Clone + 'static,
    strings: impl Strategy<Value = String> + 'static,
) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        strings.prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..6)
                .prop_map(|entries| Value::Object(entries.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn any_json() -> impl Strategy<Value = Value> {
    json_with(text(0..8), text(0..12))
}

/// Keys redaction cares about: sensitive names in several spellings, near misses, the
/// `secret_id` of a secret reference, and arbitrary text.
fn arg_key() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        3 => select(vec![
            "password", "apiKey", "X-API-Key", "APIKey", "access_token", "Authorization",
            "secret", "__token__", "Set-Cookie", "secret_id", "secret_id", "token_count",
            "max_tokens", "idempotency_key", "user", "", "passWord", "ＰＡＳＳＷＯＲＤ",
            "db_password", "github_token", "next_page_token", "password_hint", "primary_key",
            "AWS_SECRET_ACCESS_KEY", "auth",
        ])
        .prop_map(str::to_owned),
        2 => text(0..8),
    ]
}

/// Well-known credentials and near misses.
fn credential() -> impl Strategy<Value = &'static str> + Clone {
    select(vec![
        "Bearer abcdefgh12345",
        "bearer\tabcdefgh",
        "AKIAIOSFODNN7EXAMPLE",
        "sk-abcdefghijklmnopqrstuvwx",
        "ghp_aB3aB3aB3aB3aB3aB3aB3aB3aB3aB3aB3aB3",
        "xoxb-1234567890",
        "-----BEGIN RSA PRIVATE KEY-----",
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOY\n-----END PGP PRIVATE KEY BLOCK-----",
        "Basic dXNlcjpwYXNz",
        "postgres://app:s3cret@db/x",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln",
        "sk_live_51Hx2AbCdEfGhIjKlMn",
        "glpat-z_sxgtrfAxKr8q1TPY8Y",
        "github_pat_abcdefghijklmnopqrstuv",
        "xapp-1-A0123-456",
        "Bearer short",
        "Basic plan",
        "https://example.com/a@b",
        "eyJa.eyJb.",
        "task-12345678901234567890",
    ])
}

/// Strings that carry (or nearly carry) a well-known credential, alone or inside other text.
fn arg_string() -> impl Strategy<Value = String> {
    let credential = credential();
    prop_oneof![
        3 => text(0..12),
        1 => credential.clone().prop_map(str::to_owned),
        1 => (text(0..6), credential, text(0..6)).prop_map(|(a, c, b)| format!("{a} {c} {b}")),
    ]
}

/// Free text: credentials, near misses, hostile text and the punctuation around credentials,
/// run together with no space between, so one piece may end where the next begins.
fn free_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        2 => credential().prop_map(str::to_owned),
        2 => text(0..6),
        1 => select(vec![" ", ":", "/", "@", "-", ".", "\n", "https://", "Bearer ", "Basic ", REDACTED])
            .prop_map(str::to_owned),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|pieces| pieces.concat())
}

fn args() -> impl Strategy<Value = Value> {
    json_with(arg_key(), arg_string())
}

/// Rules with up to three extra key names (arbitrary text, commas included) and value checking
/// on or off; the flag is returned too, since `Rules` keeps it private.
fn rules() -> impl Strategy<Value = (Rules, bool)> {
    (prop::collection::vec(arg_key(), 0..3), any::<bool>())
        .prop_map(|(extra, check)| (Rules::new(Some(&extra.join(",")), check), check))
}

/// Arguments around the 8192-byte summary limit: objects of long strings (sensitive ones
/// shrink when redacted), arrays of them, and `{"a": "xx…"}` right at the boundary.
fn large_args() -> impl Strategy<Value = Value> {
    let long = text(0..3000).prop_map(Value::String);
    prop_oneof![
        3 => prop::collection::vec((arg_key(), prop_oneof![long.clone(), args()]), 0..7)
            .prop_map(|entries| Value::Object(entries.into_iter().collect())),
        1 => prop::collection::vec(long, 0..7).prop_map(Value::Array),
        1 => (8170usize..8200).prop_map(|n| json!({"a": "x".repeat(n)})),
    ]
}

/// `v` as JSON text in `jsonb_out`'s spacing, each object's keys in an order picked by `seed`,
/// and with `escape` every string character written as `\uXXXX` (astral ones as UTF-16 pairs).
fn scrambled(v: &Value, seed: u64, escape: bool, out: &mut String) {
    let string = |s: &str, out: &mut String| {
        if escape {
            out.push('"');
            for unit in s.encode_utf16() {
                let _ = write!(out, "\\u{unit:04x}");
            }
            out.push('"');
        } else {
            out.push_str(&Value::from(s).to_string());
        }
    };
    match v {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by_key(|(k, _)| {
                let mut h = DefaultHasher::new();
                (seed, k).hash(&mut h);
                h.finish()
            });
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                string(k, out);
                out.push_str(": ");
                scrambled(item, seed, escape, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                scrambled(item, seed, escape, out);
            }
            out.push(']');
        }
        Value::String(s) => string(s, out),
        other => out.push_str(&other.to_string()),
    }
}

/// Text that is mostly not JSON: random tokens (brackets, quotes, escapes such as a lone
/// `\ud800`, numbers out of any range), runs of openers, lossy random bytes, random strings.
fn junk() -> impl Strategy<Value = String> {
    let token = select(vec![
        "[",
        "]",
        "{",
        "}",
        "\"",
        "\\",
        "\\\"",
        "\\u",
        "\\ud800",
        "\\udc00",
        "\\ud83d\\ude00",
        "\\ud800\\u0041",
        "\\u0000",
        ":",
        ",",
        "0",
        "-1.5e7",
        "1e999999",
        "01",
        "true",
        "nul",
        " ",
        "\n",
        "\"k\":",
        "é",
        "\u{0}",
        "\u{7f}",
    ]);
    let opener = select(vec!["[", "{\"a\":", "[{\"b\":", "{\"[\\\"\":", "[\"]\","]);
    prop_oneof![
        2 => prop::collection::vec(token, 0..64).prop_map(|t| t.concat()),
        1 => (opener, 0usize..300, text(0..4)).prop_map(|(o, n, tail)| o.repeat(n) + &tail),
        1 => prop::collection::vec(any::<u8>(), 0..128)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        1 => text(0..32),
    ]
}

/// A secret reference: an object whose `secret_id` is a string that is not blank.
fn is_reference(v: &Value) -> bool {
    v.get("secret_id")
        .and_then(Value::as_str)
        .is_some_and(|id| !id.trim().is_empty())
}

/// Whether `output` is what a secret reference becomes: `{"secret_id": <string>}` alone.
fn is_reference_alone(output: &Value) -> bool {
    output.as_object().is_some_and(|m| m.len() == 1) && output["secret_id"].is_string()
}

/// Whether every value under a sensitive key of `input` is "[REDACTED]" in `output`, except a
/// secret reference, which becomes `{"secret_id": <string>}` alone.
fn sensitive_values_redacted(rules: &Rules, input: &Value, output: &Value) -> bool {
    match (input, output) {
        (Value::Object(a), Value::Object(b)) => a.iter().all(|(k, v)| {
            let Some(out) = b.get(k) else { return false };
            if !is_sensitive_key(rules, k) {
                sensitive_values_redacted(rules, v, out)
            } else if is_reference(v) {
                is_reference_alone(out)
            } else {
                out == REDACTED
            }
        }),
        (Value::Array(a), Value::Array(b)) => a
            .iter()
            .zip(b)
            .all(|(x, y)| sensitive_values_redacted(rules, x, y)),
        _ => true,
    }
}

/// Whether `output` has the shape of `input`: the same keys, the same array lengths, the same
/// scalars, except where a whole value became "[REDACTED]" or a secret reference under a
/// sensitive key its `secret_id` alone.
fn same_shape(rules: &Rules, input: &Value, output: &Value) -> bool {
    match (input, output) {
        (_, out) if out == REDACTED => true,
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len()
                && a.iter().zip(b).all(|((ka, va), (kb, vb))| {
                    ka == kb
                        && (same_shape(rules, va, vb)
                            || (is_sensitive_key(rules, ka)
                                && is_reference(va)
                                && is_reference_alone(vb)))
                })
        }
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_shape(rules, x, y))
        }
        (a, b) => a == b,
    }
}

fn any_credential(v: &Value) -> bool {
    match v {
        Value::String(s) => is_credential(s),
        Value::Array(items) => items.iter().any(any_credential),
        Value::Object(map) => map.values().any(any_credential),
        _ => false,
    }
}

/// Nesting made of `kinds` (true: an object, false: an array) around a number, each level also
/// holding a string full of brackets and escaped quotes that must not count.
fn nested(kinds: &[bool]) -> String {
    let mut text = String::new();
    for &object in kinds {
        text.push_str(if object {
            r#"{"k{\"[": 1, "v": "#
        } else {
            r#"["]\"{", "#
        });
    }
    text.push_str("-0.5");
    for &object in kinds.iter().rev() {
        text.push(if object { '}' } else { ']' });
    }
    text
}

/// Every Unicode White_Space character, listed independently of `char::is_whitespace`.
const WHITESPACE: [char; 25] = [
    '\t', '\n', '\u{b}', '\u{c}', '\r', ' ', '\u{85}', '\u{a0}', '\u{1680}', '\u{2000}',
    '\u{2001}', '\u{2002}', '\u{2003}', '\u{2004}', '\u{2005}', '\u{2006}', '\u{2007}', '\u{2008}',
    '\u{2009}', '\u{200a}', '\u{2028}', '\u{2029}', '\u{202f}', '\u{205f}', '\u{3000}',
];

/// Printable, non-whitespace characters (a mapped, not filtered, `hostile_char`: filters would
/// reject too many candidates). Whitespace, controls and format characters become a combining
/// acute accent, itself odd.
fn id_char() -> impl Strategy<Value = char> {
    hostile_char().prop_map(|c| {
        if c.is_whitespace() || c.is_control() || ids::is_format(c) {
            '\u{301}'
        } else {
            c
        }
    })
}

fn id_of(chars: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = String> {
    prop::collection::vec(id_char(), chars).prop_map(String::from_iter)
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn canonical_text_parses_back_to_the_value_and_is_a_fixed_point(v in any_json()) {
        let text = json::canonical(&v);
        let back = json::parse(&text).expect("canonical text parses");
        prop_assert_eq!(&back, &v);
        prop_assert_eq!(json::canonical(&back), text);
    }

    #[test]
    fn key_order_spacing_and_escapes_never_change_the_hash(
        v in any_json(),
        seed in any::<u64>(),
        escape in any::<bool>(),
    ) {
        let mut text = String::new();
        scrambled(&v, seed, escape, &mut text);
        let parsed = json::parse(&text).expect("scrambled text parses");
        prop_assert_eq!(&parsed, &v);
        prop_assert_eq!(json::request_hash(&parsed), json::request_hash(&v));
    }

    #[test]
    fn parse_refuses_junk_with_a_documented_code(text in junk()) {
        match json::parse(&text) {
            Ok(v) => prop_assert_eq!(json::parse(&json::canonical(&v)).ok(), Some(v)),
            Err(e) => {
                prop_assert!(matches!(e.code, Code::InputTooDeep | Code::JsonInvalid), "{e}");
                // The depth check runs first, so serde_json never meets its own limit.
                prop_assert!(!e.message.contains("recursion limit"), "{e}");
            }
        }
    }

    #[test]
    fn nesting_up_to_max_depth_is_accepted_and_beyond_refused(
        kinds in prop::collection::vec(any::<bool>(), 1..=MAX_DEPTH + 20),
    ) {
        let result = json::parse(&nested(&kinds));
        if kinds.len() <= MAX_DEPTH {
            prop_assert!(result.is_ok(), "{:?}", result.err());
        } else {
            prop_assert_eq!(result.err().map(|e| e.code), Some(Code::InputTooDeep));
        }
    }

    #[test]
    fn redaction_is_idempotent_and_keeps_the_shape((rules, _) in rules(), v in args()) {
        let once = redaction::redact(&rules, v.clone());
        prop_assert!(same_shape(&rules, &v, &once), "{} -> {}", v, once);
        prop_assert_eq!(redaction::redact(&rules, once.clone()), once);
    }

    #[test]
    fn values_under_sensitive_keys_are_redacted((rules, _) in rules(), v in args()) {
        let out = redaction::redact(&rules, v.clone());
        prop_assert!(sensitive_values_redacted(&rules, &v, &out), "{} -> {}", v, out);
    }

    #[test]
    fn no_credential_survives_value_checking((rules, check) in rules(), v in args()) {
        let out = redaction::redact(&rules, v.clone());
        prop_assert!(!check || !any_credential(&out), "{} -> {}", v, out);
    }

    #[test]
    fn free_text_keeps_all_but_the_credentials(s in free_text()) {
        let out = redaction::redact_text(&Rules::default(), &s);
        prop_assert_eq!(matches!(out, Cow::Borrowed(_)), !is_credential(&s), "{:?}", s);
        prop_assert!(!is_credential(&out), "{:?} -> {:?}", s, out);
        prop_assert_eq!(&redaction::redact_text(&Rules::default(), &out), &out);
        // What is left is the input's own text, in order: only the marker is added.
        let mut rest = s.as_str();
        for piece in out.split(REDACTED) {
            let at = rest.find(piece);
            prop_assert!(at.is_some(), "{:?} -> {:?}", s, out);
            rest = &rest[at.unwrap_or(0) + piece.len()..];
        }
        let off = redaction::redact_text(&Rules::new(None, false), &s);
        prop_assert!(matches!(off, Cow::Borrowed(kept) if kept == s));
    }

    #[test]
    fn valid_ids_are_accepted(id in id_of(1..=MAX_ID_CHARS)) {
        prop_assert!(ids::validate("run_id", &id).is_ok(), "{id:?}");
    }

    #[test]
    fn a_space_or_control_anywhere_in_an_id_is_refused(
        id in id_of(0..=MAX_ID_CHARS - 1),
        at in any::<Index>(),
        bad in prop_oneof![
            select(WHITESPACE.to_vec()),
            prop::char::range('\0', '\u{1f}'),
            prop::char::range('\u{7f}', '\u{9f}'),
        ],
    ) {
        let mut chars: Vec<char> = id.chars().collect();
        chars.insert(at.index(chars.len() + 1), bad);
        let id = String::from_iter(chars);
        let e = ids::validate("run_id", &id).expect_err("refused");
        prop_assert_eq!(e.code, Code::IdInvalid);
    }

    #[test]
    fn validate_refuses_only_with_id_invalid_and_the_length(id in text(0..200)) {
        let count = id.chars().count();
        match ids::validate("run_id", &id) {
            Ok(()) => prop_assert!((1..=MAX_ID_CHARS).contains(&count)),
            Err(e) => {
                prop_assert_eq!(e.code, Code::IdInvalid);
                prop_assert_eq!(&e.detail["length"], &json!(count));
            }
        }
    }

    #[test]
    fn truncation_keeps_whole_characters_of_a_prefix(s in text(0..64), max in 0usize..80) {
        let cut = truncate_chars(&s, max);
        prop_assert!(s.starts_with(cut));
        prop_assert_eq!(cut, s.chars().take(max).collect::<String>());
    }
}

proptest! {
    #![proptest_config(config(LARGE_CASES))]

    #[test]
    fn ids_of_no_or_too_many_characters_are_refused(
        id in prop_oneof![Just(String::new()), id_of(MAX_ID_CHARS + 1..=MAX_ID_CHARS + 300)],
    ) {
        let e = ids::validate("run_id", &id).expect_err("refused");
        prop_assert_eq!(e.code, Code::IdInvalid);
        prop_assert_eq!(&e.detail["length"], &json!(id.chars().count()));
    }

    #[test]
    fn normalized_keys_are_snake_case_and_a_fixed_point(
        key in prop_oneof![
            text(0..40),
            (text(1..8), 1usize..2000).prop_map(|(chunk, n)| chunk.repeat(n)),
        ],
    ) {
        match normalize_key(&key) {
            Some(k) => {
                prop_assert!(k.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
                prop_assert!(!k.starts_with('_') && !k.ends_with('_') && !k.contains("__"), "{k}");
                prop_assert_eq!(normalize_key(&k), Some(k));
            }
            // Only keys with more letters and digits than the buffer holds overflow it.
            None => prop_assert!(key.chars().filter(|c| redaction::fold(*c).is_some()).count() > KEY_BYTES / 2),
        }
        // A key means what its normalised form means, in any case.
        if let Some(k) = normalize_key(&key) {
            let rules = Rules::default();
            let sensitive = is_sensitive_key(&rules, &key);
            prop_assert_eq!(is_sensitive_key(&rules, &k), sensitive, "{:?}", key);
            prop_assert_eq!(is_sensitive_key(&rules, &k.to_uppercase()), sensitive, "{:?}", key);
        }
    }

    #[test]
    fn stored_arguments_are_small_redacted_json_or_the_truncated_form(
        (rules, _) in rules(),
        args in large_args(),
    ) {
        let redacted = redaction::redact(&rules, args.clone());
        let size = json::canonical(&redacted).len();
        let stored = redaction::summarize_arguments(&rules, args.clone(), &json::request_hash(&args));
        if size <= SUMMARY_BYTES {
            prop_assert_eq!(stored, redacted);
            return Ok(());
        }
        let Value::Object(stored) = stored else {
            return Err(TestCaseError::fail("the truncated form is an object"));
        };
        let keys: Vec<&str> = stored.keys().map(String::as_str).collect();
        prop_assert_eq!(keys, ["argument_names", "request_hash", "size_bytes", "truncated"]);
        prop_assert_eq!(&stored["truncated"], &json!(true));
        prop_assert_eq!(&stored["size_bytes"], &json!(size));
        // The unredacted hash, so it matches the record's request_hash.
        prop_assert_eq!(&stored["request_hash"], &json!(json::request_hash(&args)));
        let names: Vec<&str> = stored["argument_names"]
            .as_array()
            .expect("argument_names is an array")
            .iter()
            .map(|n| n.as_str().expect("names are strings"))
            .collect();
        prop_assert!(names.windows(2).all(|w| w[0] < w[1]), "{names:?}");
        let keys = args.as_object().map_or(0, Map::len);
        prop_assert_eq!(names.len(), keys);
        prop_assert!(names.iter().all(|n| args.get(n).is_some()));
    }
}
