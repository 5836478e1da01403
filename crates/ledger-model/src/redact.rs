//! Redaction of tool-call arguments before anything is stored.
//!
//! Values reach here through `json::parse` (or pgrx's serde_json), so their depth is bounded and
//! plain recursion is safe.

use serde_json::{json, Value};

use crate::{interrupt, json};

/// What a redacted value becomes.
pub const REDACTED: &str = "[REDACTED]";

/// The size of the fixed key buffer. No sensitive name comes near it, so a key whose normalised
/// form does not fit cannot be one and is simply not sensitive by name.
pub const KEY_BYTES: usize = 128;

pub type Key = heapless::String<KEY_BYTES>;

/// The built-in sensitive key names: the fifteen most common, then further common ones. All
/// normalised.
const SENSITIVE_KEYS: [&str; 27] = [
    "api_key",
    "apikey",
    "access_token",
    "authorization",
    "client_secret",
    "cookie",
    "credential",
    "password",
    "private_key",
    "refresh_token",
    "secret",
    "secret_access_key",
    "session_token",
    "token",
    "x_api_key",
    "auth_token",
    "bearer_token",
    "id_token",
    "passwd",
    "pwd",
    "secret_key",
    "api_secret",
    "proxy_authorization",
    "set_cookie",
    "x_auth_token",
    "credentials",
    "private_key_id",
];

/// The largest redacted arguments stored as they are, in bytes of canonical JSON.
pub const SUMMARY_BYTES: usize = 8192;

#[derive(Clone, Debug)]
pub struct Rules {
    /// Normalised, non-empty names from `ledger.redact_keys`.
    extra_keys: Vec<Key>,
    /// `ledger.redact_values`: whether string values are scanned for credentials.
    check_values: bool,
}

impl Rules {
    /// `extra_keys` is the comma list of the GUC `ledger.redact_keys`; each name is normalised
    /// like a key, and blank names (or names too long to ever match) are ignored.
    pub fn new(extra_keys: Option<&str>, check_values: bool) -> Rules {
        let extra_keys = extra_keys
            .unwrap_or("")
            .split(',')
            .filter_map(normalize_key)
            // An empty name would match keys made only of punctuation, such as "" or "-".
            .filter(|k| !k.is_empty())
            .collect();
        Rules {
            extra_keys,
            check_values,
        }
    }
}

impl Default for Rules {
    fn default() -> Rules {
        Rules::new(None, true)
    }
}

/// The normalised key: `_` inserted between `[a-z0-9]` and `[A-Z]`, ASCII-lowercased, each run of
/// characters outside `[a-z0-9]` folded to one `_`, `_` trimmed at both ends. `None` when the
/// result does not fit `KEY_BYTES`.
pub fn normalize_key(key: &str) -> Option<Key> {
    let mut out = Key::new();
    // A `_` is owed before the next letter or digit; never written at the start or the end.
    let mut gap = false;
    let mut after_lower_or_digit = false;
    for c in key.chars() {
        if c.is_ascii_uppercase() && after_lower_or_digit {
            gap = true;
        }
        after_lower_or_digit = c.is_ascii_lowercase() || c.is_ascii_digit();
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            if gap && !out.is_empty() {
                out.push('_').ok()?;
            }
            gap = false;
            out.push(c).ok()?;
        } else {
            gap = true;
        }
    }
    Some(out)
}

/// Exact membership of the normalised key: no substring or suffix matching.
pub fn is_sensitive_key(rules: &Rules, key: &str) -> bool {
    normalize_key(key)
        .is_some_and(|k| SENSITIVE_KEYS.contains(&k.as_str()) || rules.extra_keys.contains(&k))
}

/// Whether `s` carries a well-known credential anywhere in it: `Bearer <token>`, an OpenAI-style
/// `sk-` key, an AWS access key id, a GitHub or Slack token, or a PEM private key header. Except
/// for the PEM header, a match must start a word (not follow an ASCII letter or digit), so
/// `task-1...` or `pallbearer ...` do not fire.
pub fn is_credential(s: &str) -> bool {
    let bytes = s.as_bytes();
    (0..bytes.len()).any(|i| {
        if i > 0 && bytes[i - 1].is_ascii_alphanumeric() {
            return false;
        }
        let rest = &bytes[i..];
        match bytes[i] {
            // `bytes[i]` is ASCII, so `i` is a char boundary.
            b'b' | b'B' => bearer_at(&s[i..]),
            b's' => rest.starts_with(b"sk-") && run_of(&rest[3..], 20, is_key_byte),
            b'A' => {
                rest.starts_with(b"AKIA")
                    && run_of(&rest[4..], 16, |b| {
                        b.is_ascii_uppercase() || b.is_ascii_digit()
                    })
            }
            b'g' => {
                rest.len() > 4
                    && rest.starts_with(b"gh")
                    && matches!(rest[2], b'p' | b'o' | b'u' | b's' | b'r')
                    && rest[3] == b'_'
                    && run_of(&rest[4..], 36, |b| b.is_ascii_alphanumeric())
            }
            b'x' => {
                (rest.starts_with(b"xoxb-") || rest.starts_with(b"xoxp-"))
                    && run_of(&rest[5..], 10, |b| b.is_ascii_alphanumeric() || b == b'-')
            }
            _ => false,
        }
    }) || has_pem_private_key(s)
}

fn is_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// Whether `bytes` starts with at least `n` bytes satisfying `pred`.
fn run_of(bytes: &[u8], n: usize, pred: impl Fn(u8) -> bool) -> bool {
    bytes.len() >= n && bytes[..n].iter().all(|b| pred(*b))
}

/// Case-insensitive `bearer`, whitespace, then a token of at least 8 non-whitespace characters.
fn bearer_at(s: &str) -> bool {
    let Some(after) = s
        .get(..6)
        .filter(|word| word.eq_ignore_ascii_case("bearer"))
        .map(|_| &s[6..])
    else {
        return false;
    };
    let token = after.trim_start();
    token.len() < after.len()
        && token
            .chars()
            .take_while(|c| !c.is_whitespace())
            .nth(7)
            .is_some()
}

/// A `-----BEGIN <label>-----` line whose label ends in `PRIVATE KEY` (RSA, EC, OPENSSH,
/// ENCRYPTED, PKCS#8 ...). The header alone is enough: a cut-off block still leaks the key.
fn has_pem_private_key(s: &str) -> bool {
    let mut rest = s;
    while let Some(at) = rest.find("-----BEGIN ") {
        rest = &rest[at + "-----BEGIN ".len()..];
        let Some(end) = rest.find("-----") else {
            return false;
        };
        let label = &rest[..end];
        if !label.contains('\n') && label.ends_with("PRIVATE KEY") {
            return true;
        }
        // The dashes that ended this label may begin the next header.
        rest = &rest[end..];
    }
    false
}

/// A secret reference: an object holding a string `secret_id`. Kept under a sensitive key.
fn is_secret_ref(v: &Value) -> bool {
    matches!(v, Value::Object(m) if matches!(m.get("secret_id"), Some(Value::String(_))))
}

/// `v` with the value of every sensitive key (at any depth) replaced by `"[REDACTED]"`, except
/// secret references, whose own keys are redacted in turn; with value checking on, every string
/// carrying a credential is replaced too.
pub fn redact(rules: &Rules, mut v: Value) -> Value {
    redact_in_place(rules, &mut v);
    v
}

/// `redact` on a value the caller owns: nothing is rebuilt or copied but the replaced values.
pub fn redact_in_place(rules: &Rules, v: &mut Value) {
    match v {
        Value::Object(map) => {
            interrupt::check();
            for (k, item) in map.iter_mut() {
                if is_sensitive_key(rules, k) && !is_secret_ref(item) {
                    *item = Value::from(REDACTED);
                } else {
                    redact_in_place(rules, item);
                }
            }
        }
        Value::Array(items) => {
            interrupt::check();
            items.iter_mut().for_each(|x| redact_in_place(rules, x))
        }
        Value::String(s) if rules.check_values && is_credential(s) => *v = Value::from(REDACTED),
        _ => {}
    }
}

/// Free text (an error message, a note, a summary, a title) as the ledger stores it: with value
/// checking on, every credential the value patterns find in it is replaced by `[REDACTED]`, and
/// the rest of the text is kept.
pub fn redact_text<'a>(rules: &Rules, s: &'a str) -> std::borrow::Cow<'a, str> {
    if rules.check_values && is_credential(s) {
        std::borrow::Cow::Owned(REDACTED.to_owned())
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// The stored form of tool-call arguments: the redacted value when its canonical JSON is at most
/// `SUMMARY_BYTES` bytes, else `{"truncated":true,"size_bytes":n,"request_hash":h,
/// "argument_names":[..]}` with n the redacted size, h the hash of the UNREDACTED arguments (so
/// it matches the record's request_hash) and the sorted top-level keys (none for a non-object).
/// `request_hash` is `json::request_hash(args)`, which the caller has already computed; `args`
/// is consumed, so redaction happens in place.
pub fn summarize_arguments(rules: &Rules, mut args: Value, request_hash: &str) -> Value {
    redact_in_place(rules, &mut args);
    let size = json::canonical_len(&args);
    if size <= SUMMARY_BYTES {
        return args;
    }
    // Redaction keeps every key. Map keys iterate sorted (serde_json without preserve_order).
    let names: Vec<&String> = args
        .as_object()
        .map(|m| m.keys().collect())
        .unwrap_or_default();
    json!({
        "truncated": true,
        "size_bytes": size,
        "request_hash": request_hash,
        "argument_names": names,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn norm(key: &str) -> String {
        normalize_key(key).unwrap().as_str().to_owned()
    }

    fn sensitive(key: &str) -> bool {
        is_sensitive_key(&Rules::default(), key)
    }

    fn redacted(v: Value) -> Value {
        redact(&Rules::default(), v)
    }

    #[test]
    fn normalisation_vectors() {
        for (key, want) in [
            ("apiKey", "api_key"),
            ("accessToken", "access_token"),
            ("AccessToken", "access_token"),
            ("x-api-key", "x_api_key"),
            ("X-API-Key", "x_api_key"),
            ("Client-Secret", "client_secret"),
            ("API_KEY", "api_key"),
            ("X_API_KEY", "x_api_key"),
            // No split inside an acronym.
            ("APIKey", "apikey"),
            ("XAPIKey", "xapikey"),
            ("apiKEY", "api_key"),
            ("api2Key", "api2_key"),
            ("api.key", "api_key"),
            (" password ", "password"),
            ("__token__", "token"),
            ("api -- key", "api_key"),
            ("api_-_Key", "api_key"),
            ("secret key", "secret_key"),
            ("Set-Cookie", "set_cookie"),
            ("Proxy-Authorization", "proxy_authorization"),
            ("privateKeyId", "private_key_id"),
            ("mot_de_passé", "mot_de_pass"),
            ("clé_api", "cl_api"),
            ("🔑token", "token"),
            ("", ""),
            ("-_- ", ""),
            ("a", "a"),
            ("123", "123"),
        ] {
            assert_eq!(norm(key), want, "{key:?}");
        }
    }

    #[test]
    fn keys_too_long_for_the_buffer_are_not_sensitive() {
        let fits = "a".repeat(KEY_BYTES);
        assert_eq!(norm(&fits), fits);
        assert!(normalize_key(&"a".repeat(KEY_BYTES + 1)).is_none());
        // The inserted separators count toward the size.
        assert!(normalize_key(&"aB".repeat(KEY_BYTES / 2)).is_none());
        // Punctuation that folds away does not.
        let padded = format!("{}password{}", "-".repeat(500), " ".repeat(500));
        assert_eq!(norm(&padded), "password");
        assert!(sensitive(&padded));
        let long = format!("password_{}", "x".repeat(KEY_BYTES));
        assert!(!sensitive(&long));
        // Even listed explicitly: a name that does not fit is ignored.
        assert!(!is_sensitive_key(&Rules::new(Some(&long), true), &long));
    }

    #[test]
    fn every_default_name_is_sensitive() {
        assert_eq!(SENSITIVE_KEYS.len(), 27);
        for name in SENSITIVE_KEYS {
            assert_eq!(norm(name), name, "list entries are normalised");
            assert!(sensitive(name));
            assert!(sensitive(&name.to_uppercase()));
            assert!(sensitive(&name.replace('_', "-")));
        }
    }

    #[test]
    fn spellings_of_sensitive_keys() {
        for key in [
            "apiKey",
            "api_key",
            "API_KEY",
            "api-key",
            "Api-Key",
            "APIKey",
            "apikey",
            "api.key",
            "x-api-key",
            "X-API-Key",
            "X_API_KEY",
            "xApiKey",
            "accessToken",
            "AccessToken",
            "Client-Secret",
            "clientSecret",
            " password ",
            "PASSWORD",
            "Authorization",
            "Cookie",
            "Set-Cookie",
            "Proxy-Authorization",
            "x-auth-token",
            "secretKey",
            "api-secret",
            "bearerToken",
            "id_token",
            "passwd",
            "pwd",
            "credentials",
            "privateKeyId",
            "secretAccessKey",
            "sessionToken",
            "refresh-token",
            "token",
            "TOKEN",
            "secret",
        ] {
            assert!(sensitive(key), "{key:?}");
        }
    }

    #[test]
    fn keys_that_are_not_sensitive() {
        for key in [
            "token_count",
            "tokenCount",
            "idempotency_key",
            "tokens",
            "max_tokens",
            "maxTokens",
            "secretary",
            "passport",
            "key",
            "author",
            "auth",
            "cookies",
            "password_hint",
            "secret_id",
            "api",
            "access",
            // Acronym runs are not split; see keys_can_be_added_by_configuration.
            "XAPIKey",
            "",
            "-",
        ] {
            assert!(!sensitive(key), "{key:?}");
        }
    }

    #[test]
    fn keys_can_be_added_by_configuration() {
        let rules = Rules::new(Some(" Signing-Key ,, webhookSecret,  ,XAPIKey,OTP"), true);
        for key in [
            "signing_key",
            "SIGNING_KEY",
            "signingKey",
            "webhook_secret",
            "Webhook-Secret",
            "XAPIKey",
            "xapikey",
            "otp",
            "OTP",
        ] {
            assert!(is_sensitive_key(&rules, key), "{key:?}");
            assert!(!sensitive(key), "{key:?} is not a default");
        }
        // The defaults stay, blank entries add nothing.
        assert!(is_sensitive_key(&rules, "password"));
        assert!(!is_sensitive_key(&rules, ""));
        assert!(!is_sensitive_key(&rules, "-"));
        assert!(!is_sensitive_key(&rules, "signing"));
        let blank = Rules::new(Some(" , ,"), true);
        assert!(!is_sensitive_key(&blank, ""));
        assert!(!is_sensitive_key(&blank, " "));
        assert!(!is_sensitive_key(&Rules::new(Some(""), true), ""));
    }

    #[test]
    fn sensitive_values_of_any_type_are_replaced() {
        let v = redacted(json!({
            "password": "hunter2",
            "token": 12345,
            "secret": {"nested": "x"},
            "api_key": ["a", "b"],
            "cookie": null,
            "credential": true,
            "user": "alice",
            "count": 3,
        }));
        assert_eq!(
            v,
            json!({
                "password": REDACTED,
                "token": REDACTED,
                "secret": REDACTED,
                "api_key": REDACTED,
                "cookie": REDACTED,
                "credential": REDACTED,
                "user": "alice",
                "count": 3,
            })
        );
    }

    #[test]
    fn redaction_reaches_every_depth() {
        let v = redacted(json!({
            "items": [
                {"name": "a", "apiKey": "k1"},
                [{"Authorization": "x"}, {"deep": [{"x-api-key": "k2", "ok": 1}]}],
                "plain",
            ],
            "config": {"db": {"host": "h", "password": "p", "port": 5432}},
        }));
        assert_eq!(
            v,
            json!({
                "items": [
                    {"name": "a", "apiKey": REDACTED},
                    [{"Authorization": REDACTED}, {"deep": [{"x-api-key": REDACTED, "ok": 1}]}],
                    "plain",
                ],
                "config": {"db": {"host": "h", "password": REDACTED, "port": 5432}},
            })
        );
    }

    #[test]
    fn redaction_at_maximum_depth() {
        let mut text = r#"{"password":"p"}"#.to_owned();
        for _ in 1..json::MAX_DEPTH {
            text = format!(r#"{{"a":{text}}}"#);
        }
        let v = redact(&Rules::default(), json::parse(&text).unwrap());
        let mut inner = &v;
        for _ in 1..json::MAX_DEPTH {
            inner = &inner["a"];
        }
        assert_eq!(inner, &json!({"password": REDACTED}));
    }

    #[test]
    fn secret_references_are_kept_but_redacted_inside() {
        let v = redacted(json!({
            "password": {"secret_id": "sec_1", "token": "x", "label": "db"},
            "api_key": {"secret_id": "sec_2"},
        }));
        assert_eq!(
            v,
            json!({
                "password": {"secret_id": "sec_1", "token": REDACTED, "label": "db"},
                "api_key": {"secret_id": "sec_2"},
            })
        );
        // A reference nested in a reference is kept too.
        let v = redacted(json!({"secret": {"secret_id": "s", "token": {"secret_id": "t"}}}));
        assert_eq!(
            v,
            json!({"secret": {"secret_id": "s", "token": {"secret_id": "t"}}})
        );
    }

    #[test]
    fn only_a_string_secret_id_is_a_reference() {
        for secret_id in [
            json!(1),
            json!(null),
            json!({"id": "s"}),
            json!(["s"]),
            json!(true),
        ] {
            let v = redacted(json!({"password": {"secret_id": secret_id}}));
            assert_eq!(v, json!({"password": REDACTED}));
        }
        // `secret_ref` (an older spelling) is not an exemption.
        let v = redacted(json!({"password": {"secret_ref": "s"}}));
        assert_eq!(v, json!({"password": REDACTED}));
        // Under a key that is not sensitive, a reference is just an object.
        let v = redacted(json!({"db": {"secret_id": "s", "pwd": "x"}}));
        assert_eq!(v, json!({"db": {"secret_id": "s", "pwd": REDACTED}}));
    }

    #[test]
    fn secret_id_inside_a_reference_is_checked_as_a_value() {
        let v = redacted(json!({"token": {"secret_id": "Bearer abcdefgh12345"}}));
        assert_eq!(v, json!({"token": {"secret_id": REDACTED}}));
    }

    fn sk(n: usize) -> String {
        format!(
            "sk-{}",
            "a1B_-".repeat(n).chars().take(n).collect::<String>()
        )
    }

    #[test]
    fn bearer_tokens() {
        for s in [
            "Bearer abcdefgh",
            "bearer abcdefgh",
            "BEARER abcdefgh",
            "BeArEr\tabcdefgh",
            "Bearer   eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig",
            "Authorization: Bearer abc.def-ghi",
            "header=Bearer\nabcdefgh",
            "Bearer ééééééé1",
            "(Bearer abcdefgh)",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "Bearer abcdefg",
            "Bearer",
            "Bearer ",
            "Bearerabcdefghij",
            "Bearer short token here",
            "pallbearer abcdefghij",
            "xBearer abcdefghij",
            "bear abcdefghij",
            "the bearer of news",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn openai_style_keys() {
        for s in [
            sk(20),
            sk(48),
            "sk-proj-abcdefghijklmnopqrstuvwxyz0123".to_owned(),
            format!("key: {}", sk(32)),
            format!("OPENAI_API_KEY={}", sk(40)),
            format!("x_{}", sk(20)),
            format!("{}.", sk(20)),
        ] {
            assert!(is_credential(&s), "{s:?}");
        }
        for s in [
            sk(19),
            "task-1".to_owned(),
            "disk-usage".to_owned(),
            "sk-short".to_owned(),
            "risk-assessment-for-quarterly-report".to_owned(),
            format!("a{}", sk(40)),
            format!("9{}", sk(40)),
            "sk_abcdefghijklmnopqrstuvwxyz".to_owned(),
            "SK-abcdefghijklmnopqrstuvwxyz".to_owned(),
            "sk-abcdefghij.klmnopqrstuvwxyz".to_owned(),
            "sk-".to_owned(),
        ] {
            assert!(!is_credential(&s), "{s:?}");
        }
    }

    #[test]
    fn aws_access_key_ids() {
        for s in [
            "AKIAIOSFODNN7EXAMPLE",
            "aws_access_key_id = AKIAIOSFODNN7EXAMPLE",
            "AKIA0123456789ABCDEF",
            "key=AKIAIOSFODNN7EXAMPLE&x=1",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "AKIAIOSFODNN7EXAMPL",
            "AKIAiosfodnn7example",
            "akiaIOSFODNN7EXAMPLE",
            "XAKIAIOSFODNN7EXAMPLE",
            "AKIA-IOSFODNN7EXAMPLE",
            "AKIA",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn github_tokens() {
        let body = "aB3".repeat(12);
        for prefix in ["ghp_", "gho_", "ghu_", "ghs_", "ghr_"] {
            let token = format!("{prefix}{body}");
            assert!(is_credential(&token), "{token:?}");
            assert!(is_credential(&format!("token {token} used")));
            assert!(!is_credential(&token[..token.len() - 1]), "35 characters");
            assert!(!is_credential(&format!("x{token}")));
        }
        for s in [
            format!("ghx_{body}"),
            format!("ghp-{body}"),
            format!("GHP_{body}"),
            format!("ghp_{}-{}", &body[..18], &body[18..]),
            "ghp_".to_owned(),
        ] {
            assert!(!is_credential(&s), "{s:?}");
        }
    }

    #[test]
    fn slack_tokens() {
        for s in [
            "xoxb-1234567890",
            "xoxp-12345-67890-abcdef",
            "token: xoxb-123-456-AbCdEf",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "xoxb-123456789",
            "xoxa-1234567890",
            "xoxs-1234567890",
            "XOXB-1234567890",
            "xoxb_1234567890",
            "axoxb-1234567890",
            "xoxb-12345_67890",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn pem_private_keys() {
        for s in [
            "-----BEGIN PRIVATE KEY-----\nMIIE...\n-----END PRIVATE KEY-----",
            "-----BEGIN RSA PRIVATE KEY-----\nMIIE",
            "-----BEGIN EC PRIVATE KEY-----",
            "-----BEGIN OPENSSH PRIVATE KEY-----",
            "-----BEGIN ENCRYPTED PRIVATE KEY-----",
            "config:\nkey: |\n  -----BEGIN PRIVATE KEY-----\n  abc",
            "-----BEGIN X-----BEGIN RSA PRIVATE KEY-----",
            "-----BEGIN CERTIFICATE-----\n...\n-----BEGIN PRIVATE KEY-----",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "-----BEGIN PUBLIC KEY-----\nMIIB",
            "-----BEGIN CERTIFICATE-----",
            "-----BEGIN RSA PUBLIC KEY-----",
            "-----BEGIN PRIVATE KEY",
            "-----BEGIN \nPRIVATE KEY-----",
            "-----begin private key-----",
            "BEGIN PRIVATE KEY",
            "-----END PRIVATE KEY-----",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn ordinary_strings_are_not_credentials() {
        for s in [
            "",
            "hello world",
            "task-12345678901234567890",
            "ask-me-anything-about-the-weather",
            "AKIA",
            "Bearer",
            "ghp",
            "xoxb",
            "-----",
            "é😀漢字",
            "a sk",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn credential_values_are_redacted_under_any_key() {
        let token = format!("ghp_{}", "x".repeat(36));
        let v = redacted(json!({
            "headers": {"X-Custom": "Bearer abcdefgh12345"},
            "note": format!("use {} please", sk(30)),
            "list": ["AKIAIOSFODNN7EXAMPLE", "fine", token, 7],
            "pem": "-----BEGIN RSA PRIVATE KEY-----\nabc",
            "ok": "task-1",
        }));
        assert_eq!(
            v,
            json!({
                "headers": {"X-Custom": REDACTED},
                "note": REDACTED,
                "list": [REDACTED, "fine", REDACTED, 7],
                "pem": REDACTED,
                "ok": "task-1",
            })
        );
        assert_eq!(redacted(json!("xoxb-1234567890")), json!(REDACTED));
        assert_eq!(redacted(json!(["Bearer abcdefgh"])), json!([REDACTED]));
    }

    #[test]
    fn value_checking_can_be_turned_off() {
        let rules = Rules::new(None, false);
        let v = json!({
            "h": "Bearer abcdefgh12345",
            "k": "AKIAIOSFODNN7EXAMPLE",
            "list": [sk(30)],
            "password": "still redacted by name",
        });
        assert_eq!(
            redact(&rules, v.clone()),
            json!({
                "h": "Bearer abcdefgh12345",
                "k": "AKIAIOSFODNN7EXAMPLE",
                "list": [sk(30)],
                "password": REDACTED,
            })
        );
    }

    #[test]
    fn scalars_and_keys_pass_through() {
        for v in [
            json!(null),
            json!(true),
            json!(1.50),
            json!("x"),
            json!({}),
            json!([]),
        ] {
            assert_eq!(redacted(v.clone()), v);
        }
        // Numbers keep their text through redaction.
        let v = json::parse(r#"{"n": 1.50, "big": 123456789012345678901234567890}"#).unwrap();
        assert_eq!(
            json::canonical(&redacted(v)),
            r#"{"big":123456789012345678901234567890,"n":1.50}"#
        );
        // Keys are never rewritten, only values.
        let v = redacted(json!({"API-Key": "k"}));
        assert_eq!(v, json!({"API-Key": REDACTED}));
    }

    /// Arguments whose redacted canonical JSON is exactly `size` bytes: `{"a":"xxx…"}` costs 8
    /// bytes beyond the string; a password of `pad` bytes that redaction shrinks comes on top.
    fn args_of(size: usize, password: &str) -> Value {
        // `,"password":"[REDACTED]"` is 24 bytes.
        let fixed = if password.is_empty() { 8 } else { 8 + 24 };
        let mut v = json!({"a": "x".repeat(size - fixed)});
        if !password.is_empty() {
            v["password"] = json!(password);
        }
        v
    }

    #[test]
    fn summaries_keep_up_to_8192_bytes() {
        for size in [8191, 8192] {
            let args = args_of(size, "");
            assert_eq!(json::canonical(&args).len(), size);
            assert_eq!(
                summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args)),
                args
            );
        }
        let args = args_of(8193, "");
        let summary =
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args));
        assert_eq!(
            summary,
            json!({
                "truncated": true,
                "size_bytes": 8193,
                "request_hash": json::request_hash(&args),
                "argument_names": ["a"],
            })
        );
    }

    #[test]
    fn summary_size_is_measured_after_redaction() {
        // Unredacted this is far above the limit; redacted it is exactly 8192 bytes.
        let args = args_of(8192, &"p".repeat(10_000));
        assert!(json::canonical(&args).len() > 18_000);
        let summary =
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args));
        assert_eq!(json::canonical(&summary).len(), 8192);
        assert_eq!(summary["password"], json!(REDACTED));

        let args = args_of(8193, &"p".repeat(10_000));
        let summary =
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args));
        assert_eq!(summary["truncated"], json!(true));
        assert_eq!(summary["size_bytes"], json!(8193));
        // The hash is of the unredacted arguments, so it matches the record's request_hash.
        assert_eq!(summary["request_hash"], json!(json::request_hash(&args)));
        assert_ne!(
            summary["request_hash"],
            json!(json::request_hash(&redact(&Rules::default(), args.clone())))
        );
        assert_eq!(summary["argument_names"], json!(["a", "password"]));
        assert!(!json::canonical(&summary).contains("ppp"));
    }

    #[test]
    fn summary_size_counts_utf8_bytes() {
        // 'é' is 2 bytes: 4092 of them plus 8 bytes of framing is 8192 bytes, 4100 characters.
        let args = json!({"a": "é".repeat(4092)});
        assert_eq!(
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args)),
            args
        );
        let args = json!({"a": format!("{}x", "é".repeat(4092))});
        assert_eq!(
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args))
                ["size_bytes"],
            json!(8193)
        );
    }

    #[test]
    fn truncated_argument_names_are_sorted_top_level_keys() {
        let mut args = Map::new();
        for k in ["zeta", "Alpha", "beta", "_x", "é"] {
            args.insert(k.into(), json!({"inner": "y".repeat(2000)}));
        }
        let args = Value::Object(args);
        let summary =
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args));
        assert_eq!(
            summary["argument_names"],
            json!(["Alpha", "_x", "beta", "zeta", "é"])
        );
        // A non-object has no argument names.
        let args = json!(["y".repeat(9000)]);
        let summary =
            summarize_arguments(&Rules::default(), args.clone(), &json::request_hash(&args));
        assert_eq!(summary["argument_names"], json!([]));
        assert_eq!(summary["request_hash"], json!(json::request_hash(&args)));
    }
}
