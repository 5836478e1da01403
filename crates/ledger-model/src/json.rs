//! JSON in and out: depth-bounded parsing, canonical text and the request hash.
//!
//! serde_json is built with `arbitrary_precision` (numbers keep their exact text) and without
//! `preserve_order` (a `Map` is a BTreeMap, so keys iterate in byte order, which for UTF-8 is
//! code point order). Its compact writer is therefore already the canonical form.

use serde_json::Value;

use crate::error::{Code, LedgerError, Result};
use crate::hash::hex;
use crate::interrupt::{self, Checked};
use sha2::{Digest, Sha256};

/// The deepest nesting of arrays and objects the ledger accepts. Every `Value` it handles came
/// through `parse`, so other modules may recurse over values without risking the stack.
pub const MAX_DEPTH: usize = 100;

/// The largest JSON argument, in bytes of its text as PostgreSQL prints it.
pub const MAX_BYTES: usize = 16 * 1024 * 1024;

/// The most values (array elements, object members, arrays and objects) a JSON argument may
/// hold. A parsed value takes a few hundred bytes of memory however short its text, so this
/// bounds a backend's memory where `MAX_BYTES` cannot (two bytes of text, `1,`, are one value).
pub const MAX_VALUES: usize = 200_000;

/// Parses JSON text (as PostgreSQL's `jsonb_out` prints it). Nesting deeper than `MAX_DEPTH`
/// fails with `INPUT_TOO_DEEP`, more than `MAX_BYTES` or `MAX_VALUES` with `INPUT_TOO_LARGE`,
/// anything else that is not JSON with `JSON_INVALID`; all of them before anything is built.
pub fn parse(text: &str) -> Result<Value> {
    if text.len() > MAX_BYTES {
        return Err(too_large(format!(
            "JSON is larger than {} MiB",
            MAX_BYTES / 1024 / 1024
        ))
        .with("bytes", text.len()));
    }
    parse_unsized(text)
}

/// `parse` without `MAX_BYTES`, for tool-call arguments: they are hashed and summarised, never
/// stored whole, so an upload tool may take large ones (PostgreSQL bounds a jsonb string at
/// 256 MiB); depth and values stay bounded.
pub fn parse_unsized(text: &str) -> Result<Value> {
    parse_nested(text, 0)
}

/// `parse_unsized` for a value that holds arguments `levels` deep (a batch of tool calls: an
/// array of objects), so that what it holds may nest exactly as deep as on its own.
pub fn parse_nested(text: &str, levels: usize) -> Result<Value> {
    check_shape(text, MAX_DEPTH + levels)?;
    // FromStr, not from_str::<Value>: its code is serde_json's own (optimised even in test
    // builds, see the workspace Cargo.toml), not a copy instantiated in this crate.
    text.parse::<Value>()
        .map_err(|e| LedgerError::new(Code::JsonInvalid, format!("invalid JSON: {e}")))
}

fn too_large(message: String) -> LedgerError {
    LedgerError::new(Code::InputTooLarge, message)
        .with("max_bytes", MAX_BYTES)
        .with("max_values", MAX_VALUES)
}

/// Counts nesting and values without recursion, before serde_json builds anything. On any
/// valid prefix the depth equals the parser's nesting, so serde_json (limit 128) never reaches
/// its own limit; values are counted as commas and openers, plus one (an upper bound: `[]`
/// counts two). Checks for interrupts as it goes: serde_json's own parse cannot be interrupted.
fn check_shape(text: &str, max_depth: usize) -> Result<()> {
    let bytes = text.as_bytes();
    let (mut depth, mut i, mut next_check) = (0usize, 0usize, 0usize);
    let mut values = 1usize;
    while i < bytes.len() {
        if i >= next_check {
            interrupt::check();
            next_check = i + interrupt::EVERY_BYTES;
        }
        match bytes[i] {
            // Brackets inside strings do not nest; an escaped quote does not end the string.
            // Multi-byte UTF-8 sequences never contain ASCII bytes, so bytes are safe here.
            b'"' => {
                i += 1;
                while i < bytes.len() {
                    match bytes[i] {
                        b'\\' => i += 2,
                        b'"' => break,
                        _ => i += 1,
                    }
                }
            }
            b',' => values += 1,
            b'[' | b'{' => {
                values += 1;
                depth += 1;
                if depth > max_depth {
                    return Err(LedgerError::new(
                        Code::InputTooDeep,
                        format!("JSON nested deeper than {max_depth} levels"),
                    )
                    .with("max_depth", max_depth));
                }
            }
            // Unbalanced closers are left to serde_json to report as invalid.
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    if values > MAX_VALUES {
        return Err(too_large(format!(
            "JSON holds more than {MAX_VALUES} values"
        )));
    }
    Ok(())
}

/// Canonical JSON: keys sorted by code point, no insignificant whitespace, strings escaped
/// minimally (only `"`, `\` and control characters; UTF-8 kept), numbers exactly as their text.
pub fn canonical(v: &Value) -> String {
    let mut out = Checked::new(Vec::new());
    // Neither serialising a Value nor writing into a Vec can fail, and the output is UTF-8.
    let _ = serde_json::to_writer(&mut out, v);
    String::from_utf8(out.into_inner()).unwrap_or_default()
}

/// Hex SHA-256 of the canonical JSON, serialised straight into the hasher (no copy of a large
/// document).
pub fn request_hash(v: &Value) -> String {
    let mut hasher = Checked::new(Sha256::new());
    // Neither serialising a Value nor writing into a hasher can fail.
    let _ = serde_json::to_writer(&mut hasher, v);
    hex(&hasher.into_inner().finalize())
}

/// The length in bytes of the canonical JSON, without building it.
pub fn canonical_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Checked::new(Count(0));
    // Counting bytes cannot fail, nor can serialising a Value.
    let _ = serde_json::to_writer(&mut count, v);
    count.into_inner().0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Class;
    use crate::hash::sha256_hex;
    use serde_json::{json, Map};
    use std::time::{Duration, Instant};

    fn canon(text: &str) -> String {
        canonical(&parse(text).unwrap())
    }

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn keys_are_sorted_at_every_level() {
        assert_eq!(
            canon(r#"{"b": 1, "a": {"z": [ {"y": 1, "x": 2} ], "c": null}, "A": true}"#),
            r#"{"A":true,"a":{"c":null,"z":[{"x":2,"y":1}]},"b":1}"#
        );
    }

    #[test]
    fn keys_sort_by_code_point_not_by_utf16_or_locale() {
        // U+FF61 sorts after U+1F600 in UTF-16 order but before it by code point.
        let v = json!({"😀": 1, "｡": 2, "é": 3, "z": 4, "Z": 5, "": 6});
        assert_eq!(canonical(&v), r#"{"":6,"Z":5,"z":4,"é":3,"｡":2,"😀":1}"#);
    }

    #[test]
    fn insertion_order_does_not_matter() {
        let mut forward = Map::new();
        let mut backward = Map::new();
        let keys = ["delta", "alpha", "charlie", "bravo"];
        for (i, k) in keys.iter().enumerate() {
            forward.insert((*k).into(), json!({"n": i, "m": [i]}));
        }
        for (i, k) in keys.iter().enumerate().rev() {
            backward.insert((*k).into(), json!({"m": [i], "n": i}));
        }
        let (forward, backward) = (Value::Object(forward), Value::Object(backward));
        assert_eq!(canonical(&forward), canonical(&backward));
        assert_eq!(request_hash(&forward), request_hash(&backward));
        assert!(canonical(&forward).starts_with(r#"{"alpha":"#));
    }

    #[test]
    fn unicode_is_kept_raw() {
        let text = canon(r#"{"k": "é 😀 漢字 \u00e9 \ud83d\ude00"}"#);
        assert_eq!(text, "{\"k\":\"é 😀 漢字 é 😀\"}");
        assert!(!text.contains("\\u"));
        // Characters JSON does not require escaping stay raw too.
        assert_eq!(canonical(&json!("\u{7f}\u{2028}/")), "\"\u{7f}\u{2028}/\"");
    }

    #[test]
    fn only_quotes_backslashes_and_controls_are_escaped() {
        let v = json!("q\" b\\ n\n r\r t\t b\u{8} f\u{c} nul\u{0} us\u{1f}");
        assert_eq!(
            canonical(&v),
            r#""q\" b\\ n\n r\r t\t b\b f\f nul\u0000 us\u001f""#
        );
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        // jsonb_out prints numerics in plain notation, never with an exponent.
        for n in [
            "0",
            "1.0",
            "-0",
            "1.50",
            "0.1",
            "100.000",
            "-0.0000000001",
            "123456789012345678901234567890",
            "-123456789012345678901234567890.000000000000000000001",
        ] {
            assert_eq!(canon(n), n);
            assert_eq!(canon(&format!("[{n}]")), format!("[{n}]"));
        }
        // Equal numbers written differently are different requests.
        assert_ne!(
            request_hash(&parse("1.0").unwrap()),
            request_hash(&parse("1").unwrap())
        );
    }

    #[test]
    fn exponents_are_written_one_way() {
        // serde_json keeps the digits but writes a lowercase `e` with an explicit sign. Text
        // from jsonb_out has no exponents; other text still gets one stable form.
        for (n, want) in [
            ("1e2", "1e+2"),
            ("1E2", "1e+2"),
            ("1E+2", "1e+2"),
            ("1e-2", "1e-2"),
            ("-1.25E-10", "-1.25e-10"),
            ("1.50e007", "1.50e+007"),
        ] {
            assert_eq!(canon(n), want);
            assert_eq!(canon(want), want);
        }
    }

    #[test]
    fn whitespace_is_dropped_and_empties_kept() {
        assert_eq!(canon(" { } "), "{}");
        assert_eq!(canon("[ ]"), "[]");
        assert_eq!(canon(r#"{ "a" : [ ] , "b" : { } }"#), r#"{"a":[],"b":{}}"#);
        assert_eq!(
            canon(r#" [ 1 , true , null , "x" ] "#),
            r#"[1,true,null,"x"]"#
        );
        assert_eq!(canon(r#""""#), r#""""#);
    }

    #[test]
    fn hash_vectors() {
        assert_eq!(
            request_hash(&json!({})),
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert_eq!(request_hash(&json!({})), sha256_hex(b"{}"));
        assert_eq!(
            request_hash(&parse(r#"{"b": "é", "a": 1.50}"#).unwrap()),
            sha256_hex("{\"a\":1.50,\"b\":\"é\"}".as_bytes())
        );
        // Hex, lowercase, 64 characters, and stable across calls.
        let h = request_hash(&json!([1, {"x": "y"}]));
        assert_eq!(h.len(), 64);
        assert!(h
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_eq!(h, request_hash(&json!([1, {"x": "y"}])));
    }

    #[test]
    fn canonical_text_parses_back_to_itself() {
        let text = r#"{"z":[1.0,-0,{"b":"\n","a":"😀"}],"a":1e2}"#;
        let once = canon(text);
        assert_eq!(canon(&once), once);
    }

    #[test]
    fn size_and_value_count_are_bounded_before_parsing() {
        let many = |n: usize| format!("[{}]", vec!["1"; n].join(","));
        // The array and its elements.
        assert!(parse(&many(MAX_VALUES - 1)).is_ok());
        let e = parse(&many(MAX_VALUES)).unwrap_err();
        assert_eq!(
            (e.class(), e.code),
            (Class::InvalidParameter, Code::InputTooLarge)
        );
        assert_eq!(e.detail["max_values"], MAX_VALUES);
        // Commas inside strings are not values.
        assert!(parse(&format!("[\"{}\"]", ",".repeat(MAX_VALUES))).is_ok());
        let members = format!(
            "{{{}}}",
            (0..MAX_VALUES - 1)
                .map(|i| format!("\"k{i}\": {i}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        assert!(parse(&members).is_ok(), "a member counts once");
        let fits = format!("\"{}\"", "a".repeat(MAX_BYTES - 2));
        assert!(parse(&fits).is_ok());
        let over = format!("\"{}\"", "a".repeat(MAX_BYTES - 1));
        let e = parse(&over).unwrap_err();
        assert_eq!(e.code, Code::InputTooLarge);
        assert_eq!(e.detail["bytes"], MAX_BYTES + 1);
        assert!(
            parse_unsized(&over).is_ok(),
            "tool-call arguments are not sized"
        );
        assert_eq!(
            parse_unsized(&many(MAX_VALUES)).unwrap_err().code,
            Code::InputTooLarge
        );
    }

    #[test]
    fn depth_100_is_accepted_and_101_refused() {
        assert!(parse(&nested(MAX_DEPTH)).is_ok());
        let objects = format!("{}1{}", r#"{"a":"#.repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
        assert!(parse(&objects).is_ok());

        for text in [
            nested(MAX_DEPTH + 1),
            format!("{}1{}", r#"{"a":"#.repeat(101), "}".repeat(101)),
            // Mixed arrays and objects count alike.
            format!("{}{}", r#"[{"a":"#.repeat(51), "}]".repeat(51)),
        ] {
            let e = parse(&text).unwrap_err();
            assert_eq!(e.code, Code::InputTooDeep);
            assert_eq!(e.class(), Class::InvalidParameter);
            assert_eq!(e.detail["max_depth"], json!(100));
        }
    }

    #[test]
    fn depth_is_nesting_not_total_brackets() {
        let wide = format!("[{}]", vec![nested(MAX_DEPTH - 1); 1000].join(","));
        assert!(parse(&wide).is_ok());
    }

    #[test]
    fn pathological_depth_is_refused_quickly() {
        let start = Instant::now();
        for text in [
            nested(100_000),
            "[".repeat(100_000),
            format!("{}1{}", r#"{"a":"#.repeat(100_000), "}".repeat(100_000)),
        ] {
            assert_eq!(parse(&text).unwrap_err().code, Code::InputTooDeep);
        }
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn brackets_inside_strings_do_not_count() {
        let inner = "[{".repeat(500);
        let text = format!(r#"{{"k": "{inner}", "e": "\"[[[[\\", "b": "\\\"{{{{"}}"#);
        let v = parse(&text).unwrap();
        assert_eq!(v["k"], json!(inner));
        assert_eq!(v["e"], json!("\"[[[[\\"));
        assert_eq!(v["b"], json!("\\\"{{"));
        // A string ending in an escaped backslash closes; the next brackets count again.
        let text = format!(r#"["\\", {}]"#, nested(MAX_DEPTH));
        assert_eq!(parse(&text).unwrap_err().code, Code::InputTooDeep);
        let text = format!(r#"["\\", {}]"#, nested(MAX_DEPTH - 1));
        assert!(parse(&text).is_ok());
    }

    #[test]
    fn invalid_json_is_refused() {
        for text in [
            "",
            " ",
            "{",
            "[1,]",
            r#"{"a" 1}"#,
            r#"{a: 1}"#,
            "'x'",
            r#""unterminated"#,
            "[1] [2]",
            "]]]]",
            "}{",
            "NaN",
            "01",
            "1.",
            r#""\x""#,
            "[\"raw\nnewline\"]",
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.code, Code::JsonInvalid, "{text:?}");
            assert_eq!(e.class(), Class::InvalidParameter);
        }
    }

    #[test]
    fn unbalanced_closers_do_not_hide_depth() {
        let text = format!("{}{}", "]".repeat(10), "[".repeat(100_000));
        assert_eq!(parse(&text).unwrap_err().code, Code::InputTooDeep);
    }
}
