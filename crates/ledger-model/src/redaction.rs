//! Redaction of tool-call arguments and free text before anything is stored.
//!
//! Values reach here through `json::parse` (or pgrx's serde_json), so their depth is bounded and
//! plain recursion is safe. Keys and strings can be megabytes long: every scan here is linear
//! and checks for interrupts as it goes.

use std::borrow::Cow;
use std::ops::Range;

use serde_json::{json, Map, Value};

use crate::{ids, interrupt, json};

/// What a redacted value becomes.
pub const REDACTED: &str = "[REDACTED]";

/// The size of the fixed buffer `normalize_key` writes into. Only names from `ledger.redact_keys`
/// are compared in that form, and a key whose normalised form does not fit cannot equal one.
pub const KEY_BYTES: usize = 128;

pub type Key = heapless::String<KEY_BYTES>;

/// The largest redacted arguments stored as they are, in bytes of canonical JSON.
pub const SUMMARY_BYTES: usize = 8192;

#[derive(Clone, Debug)]
pub struct Rules {
    /// Normalised, non-empty names from `ledger.redact_keys`.
    extra_keys: Vec<Key>,
    /// `ledger.redact_values`: whether strings are scanned for credentials.
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

// ---------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
pub enum Case {
    Upper,
    Lower,
    Digit,
}

/// A key character as the rules read it: an ASCII letter or digit, lowercased, with its case.
/// Full-width forms and mathematical alphanumerics (Unicode compatibility forms of ASCII, which
/// NFKC folds the same way) count as their ASCII letter; every other character separates words.
pub fn fold(c: char) -> Option<(u8, Case)> {
    let (byte, case) = match c {
        'a'..='z' => (c as u8, Case::Lower),
        'A'..='Z' => (c as u8 + 32, Case::Upper),
        '0'..='9' => (c as u8, Case::Digit),
        '\u{FF10}'..='\u{FF19}' => (b'0' + (c as u32 - 0xFF10) as u8, Case::Digit),
        '\u{FF21}'..='\u{FF3A}' => (b'a' + (c as u32 - 0xFF21) as u8, Case::Upper),
        '\u{FF41}'..='\u{FF5A}' => (b'a' + (c as u32 - 0xFF41) as u8, Case::Lower),
        // Thirteen styles of 26 capitals then 26 small letters (bold, italic, script ...).
        '\u{1D400}'..='\u{1D6A3}' => match (c as u32 - 0x1D400) % 52 {
            n @ 0..=25 => (b'a' + n as u8, Case::Upper),
            n => (b'a' + (n - 26) as u8, Case::Lower),
        },
        // Five styles of ten digits.
        '\u{1D7CE}'..='\u{1D7FF}' => (b'0' + ((c as u32 - 0x1D7CE) % 10) as u8, Case::Digit),
        _ => return None,
    };
    Some((byte, case))
}

/// The words of a key, as slices of it: runs of letters and digits (see `fold`), split where a
/// capital follows a small letter or digit (`apiKey`) and before the last capital of a run
/// followed by a small letter (`APIKey`: `API`, `Key`). Invisible format characters (zero-width
/// spaces, joiners, bidi marks) are skipped, so `pass\u{200b}word` is one word. Without
/// `by_case`, only separators split (`ApIkEy` is one word).
struct Words<'a> {
    key: &'a str,
    by_case: bool,
    chars: std::iter::Peekable<std::str::CharIndices<'a>>,
    /// The current word's start and end, and the case of its last character.
    word: Option<(usize, usize, Case)>,
    next_check: usize,
}

fn words(key: &str, by_case: bool) -> Words<'_> {
    Words {
        key,
        by_case,
        chars: key.char_indices().peekable(),
        word: None,
        // Short keys need no check: `redact_in_place` checks once per object.
        next_check: interrupt::EVERY_BYTES,
    }
}

impl<'a> Iterator for Words<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        while let Some((at, c)) = self.chars.next() {
            if at >= self.next_check {
                interrupt::check();
                self.next_check = at + interrupt::EVERY_BYTES;
            }
            // Invisible format characters are never ASCII: most keys skip the lookup.
            if !c.is_ascii() && ids::is_format(c) {
                continue;
            }
            let end = at + c.len_utf8();
            let Some((_, case)) = fold(c) else {
                if let Some((start, last, _)) = self.word.take() {
                    return Some(&self.key[start..last]);
                }
                continue;
            };
            let Some((start, last, prev)) = self.word else {
                self.word = Some((at, end, case));
                continue;
            };
            let next_is_lower = self
                .chars
                .peek()
                .is_some_and(|&(_, n)| matches!(fold(n), Some((_, Case::Lower))));
            if self.by_case && case == Case::Upper && (prev != Case::Upper || next_is_lower) {
                self.word = Some((at, end, case));
                return Some(&self.key[start..last]);
            }
            self.word = Some((start, end, case));
        }
        self.word
            .take()
            .map(|(start, last, _)| &self.key[start..last])
    }
}

/// A word's folded letters and digits.
fn folded(word: &str) -> impl DoubleEndedIterator<Item = u8> + '_ {
    word.chars().filter_map(fold).map(|(b, _)| b)
}

/// The normalised key: its words, folded and joined with `_` (`X-API-Key` and `xApiKey` →
/// `x_api_key`, `APIKey` → `api_key`, `ＰＡＳＳＷＯＲＤ` → `password`). `None` when the result
/// does not fit `KEY_BYTES`.
pub fn normalize_key(key: &str) -> Option<Key> {
    let mut out = Key::new();
    for word in words(key, true) {
        if !out.is_empty() {
            out.push('_').ok()?;
        }
        for b in folded(word) {
            out.push(char::from(b)).ok()?;
        }
    }
    Some(out)
}

/// Nouns that name a secret wherever they end the last word: `db_password`, `PGPASSWORD`,
/// `clientSecret`, `Proxy-Authorization`, `Set-Cookie`, `credentials`.
const SECRET_NOUNS: [&str; 7] = [
    "password",
    "passwd",
    "passphrase",
    "secret",
    "credential",
    "authorization",
    "cookie",
];

/// Words that name a secret only whole: `auth` (not `oauth`), `pwd` (not `OLDPWD`, a directory),
/// `cred`, `jwt`, and Redis's `requirepass` and `masterauth`.
const SECRET_WORDS: [&str; 6] = ["auth", "pwd", "cred", "jwt", "requirepass", "masterauth"];

/// Short forms that name a secret only after another word (`DB_PASS`, `GITHUB_PAT`): alone,
/// `pass` is more often a test result.
const QUALIFIED_WORDS: [&str; 2] = ["pass", "pat"];

/// What makes a `key` (or a list of `tokens`) a secret: `api_key`, `secretAccessKey`,
/// `access_tokens`. Any other key (`primary_key`, `public_key`, `cache_key`) or list of tokens
/// (`max_tokens`, `input_tokens`) is not.
const SECRET_QUALIFIERS: [&str; 29] = [
    "access",
    "account",
    "api",
    "app",
    "auth",
    "bearer",
    "client",
    "consumer",
    "decryption",
    "developer",
    "encryption",
    "functions",
    "hmac",
    "license",
    "master",
    "private",
    "refresh",
    "restricted",
    "role",
    "secret",
    "service",
    "session",
    "shared",
    "signing",
    "ssh",
    "storage",
    "subscription",
    "tls",
    "webhook",
];

/// A `token` is a secret unless it is one of these: a pagination cursor (`next_page_token`,
/// `NextToken`), a tokenizer's special token (`eos_token`), a limit, an idempotency token.
const PLAIN_TOKEN_QUALIFIERS: [&str; 23] = [
    "bos",
    "cls",
    "continuation",
    "cursor",
    "end",
    "eos",
    "idempotency",
    "mask",
    "max",
    "min",
    "next",
    "pad",
    "page",
    "pagination",
    "prev",
    "previous",
    "resume",
    "sep",
    "special",
    "start",
    "stop",
    "sync",
    "unk",
];

/// Trailing words that say how a value is written, or that it repeats another, not what it is:
/// `secret_value`, `password_b64`, `SECRET_KEY_BASE`, `private_key_pem`, `password_hash`,
/// `password_confirmation`. Numbers too (`password_2`). `file`, `path`, `id`, `name` are not
/// among them: those name where or which a secret is, not the secret.
const TRAILING_WORDS: [&str; 25] = [
    "again",
    "b64",
    "base",
    "base64",
    "binary",
    "bytes",
    "confirm",
    "confirmation",
    "data",
    "enc",
    "encoded",
    "hash",
    "hashed",
    "hex",
    "json",
    "pem",
    "plain",
    "plaintext",
    "raw",
    "repeat",
    "str",
    "string",
    "text",
    "value",
    "values",
];

/// Longer than every trailing word: a word that does not fit is one only if all digits.
const TRAILING_BYTES: usize = 16;

fn is_trailing(word: &str) -> bool {
    // Folded once (every key's every word comes here), then compared with the list.
    let mut buf = heapless::Vec::<u8, TRAILING_BYTES>::new();
    for b in folded(word) {
        if buf.push(b).is_err() {
            return folded(word).all(|b| b.is_ascii_digit());
        }
    }
    buf.iter().all(u8::is_ascii_digit) || TRAILING_WORDS.iter().any(|t| t.as_bytes() == &buf[..])
}

/// The longest folded tail of a word the rules look at: the longest qualifier and noun joined
/// (`subscription` + `tokens`) fit with room to spare, so a longer word's cut tail equals none.
const TAIL_BYTES: usize = 24;

/// The last `TAIL_BYTES` folded bytes of a word, with its trailing digits dropped (`password2`).
fn tail(word: &str) -> heapless::Vec<u8, TAIL_BYTES> {
    let mut rev: heapless::Vec<u8, TAIL_BYTES> = folded(word)
        .rev()
        .skip_while(u8::is_ascii_digit)
        .take(TAIL_BYTES)
        .collect();
    rev.reverse();
    rev
}

fn listed(list: &[&str], word: &[u8]) -> bool {
    list.iter().any(|w| w.as_bytes() == word)
}

/// Whether a key whose last word is `head` (after `before`, empty when there is none) names a
/// secret. Both are folded tails (see `tail`).
fn names_a_secret<'a>(before: &'a [u8], head: &'a [u8]) -> bool {
    // A plural names what its singular names (`passwords`, `cookies`, `api_keys`).
    let one = head.strip_suffix(b"s").unwrap_or(head);
    // The qualifier of a noun ending the head: what precedes it in the word, else the word before.
    let qualifier = |q: &'a [u8]| if q == b"" { before } else { q };
    let noun = |n: &str| {
        let n = n.as_bytes();
        // Also across the last two words: `pass` + `word`, `Pass` + `Phrase`.
        one.ends_with(n)
            || (!one.is_empty()
                && n.len() > one.len()
                && n.ends_with(one)
                && before.ends_with(&n[..n.len() - one.len()]))
    };
    if SECRET_NOUNS.iter().any(|n| noun(n))
        || listed(&SECRET_WORDS, head)
        || listed(&SECRET_WORDS, one)
        || (!before.is_empty() && listed(&QUALIFIED_WORDS, head))
    {
        return true;
    }
    if let Some(q) = head.strip_suffix(b"tokens") {
        return listed(&SECRET_QUALIFIERS, qualifier(q));
    }
    if let Some(q) = head.strip_suffix(b"token") {
        let q = qualifier(q);
        return q.is_empty() || !listed(&PLAIN_TOKEN_QUALIFIERS, q);
    }
    if let Some(q) = one.strip_suffix(b"key") {
        return listed(&SECRET_QUALIFIERS, qualifier(q));
    }
    false
}

/// Whether `key` names a secret. By meaning: the key's last word, skipping `TRAILING_WORDS`,
/// decides (`db_password`, `api_key` and `github_token` do; `password_hint`, `secret_id`,
/// `token_count`, `max_tokens` and `primary_key` do not); see `names_a_secret`. A key in odd
/// case (`ApIkEy`, `pAsSwOrD`, `APIkey`), whose case split yields a word of one or two letters,
/// is also read split by separators only: camel case never cuts a name into such pieces, so
/// the pieces are not words. By name: the normalised key equals a name in `ledger.redact_keys`.
pub fn is_sensitive_key(rules: &Rules, key: &str) -> bool {
    let (by_case, odd_case) = by_meaning(words(key, true));
    by_case
        || (odd_case && by_meaning(words(key, false)).0)
        || (!rules.extra_keys.is_empty()
            && normalize_key(key).is_some_and(|k| rules.extra_keys.contains(&k)))
}

/// Whether the last word that is not a trailing one names a secret, and whether, of two words
/// or more, one has at most two letters or digits.
fn by_meaning<'a>(words: impl Iterator<Item = &'a str>) -> (bool, bool) {
    let (mut prev, mut last) = (None, None);
    let (mut count, mut short) = (0usize, false);
    for word in words {
        count += 1;
        short |= folded(word).nth(2).is_none();
        if !is_trailing(word) {
            last = Some((prev, word));
        }
        prev = Some(word);
    }
    let secret = last.is_some_and(|(before, head)| {
        names_a_secret(&before.map(tail).unwrap_or_default(), &tail(head))
    });
    (secret, count > 1 && short)
}

// ---------------------------------------------------------------------------------------------
// Values and free text
// ---------------------------------------------------------------------------------------------

fn key_byte(b: &u8) -> bool {
    b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-'
}

fn upper_or_digit(b: &u8) -> bool {
    b.is_ascii_uppercase() || b.is_ascii_digit()
}

fn alnum_or_underscore(b: &u8) -> bool {
    b.is_ascii_alphanumeric() || *b == b'_'
}

fn alnum_or_dash(b: &u8) -> bool {
    b.is_ascii_alphanumeric() || *b == b'-'
}

/// A token known by its prefix: the prefix, the fewest body bytes that make one, which bytes the
/// body holds.
type Prefixed = (&'static str, usize, fn(&u8) -> bool);

/// Stripe's publishable keys (`pk_live_`) are public by design and not here.
const PREFIXED: [Prefixed; 32] = [
    // OpenAI (`sk-proj-` too), Anthropic (`sk-ant-`).
    ("sk-", 20, key_byte),
    // Stripe secret and restricted keys.
    ("sk_live_", 16, u8::is_ascii_alphanumeric),
    ("sk_test_", 16, u8::is_ascii_alphanumeric),
    ("rk_live_", 16, u8::is_ascii_alphanumeric),
    ("rk_test_", 16, u8::is_ascii_alphanumeric),
    // AWS access key ids, long-term and temporary.
    ("AKIA", 16, upper_or_digit),
    ("ASIA", 16, upper_or_digit),
    // GitHub: classic tokens and fine-grained personal access tokens.
    ("ghp_", 36, u8::is_ascii_alphanumeric),
    ("gho_", 36, u8::is_ascii_alphanumeric),
    ("ghu_", 36, u8::is_ascii_alphanumeric),
    ("ghs_", 36, u8::is_ascii_alphanumeric),
    ("ghr_", 36, u8::is_ascii_alphanumeric),
    ("github_pat_", 22, alnum_or_underscore),
    // GitLab's token prefixes (personal, OAuth application secret, deploy, runner, CI job,
    // trigger, feed, incoming mail, agent, SCIM, feature flags client).
    ("glpat-", 20, key_byte),
    ("gloas-", 20, key_byte),
    ("gldt-", 20, key_byte),
    ("glrt-", 20, key_byte),
    ("glrtr-", 20, key_byte),
    ("glcbt-", 20, key_byte),
    ("glptt-", 20, key_byte),
    ("glft-", 20, key_byte),
    ("glimt-", 20, key_byte),
    ("glagent-", 20, key_byte),
    ("glsoat-", 20, key_byte),
    ("glffct-", 20, key_byte),
    // Slack: bot, user, workspace, refresh, session, rotating refresh and app-level tokens.
    ("xoxb-", 10, alnum_or_dash),
    ("xoxp-", 10, alnum_or_dash),
    ("xoxa-", 10, alnum_or_dash),
    ("xoxr-", 10, alnum_or_dash),
    ("xoxs-", 10, alnum_or_dash),
    ("xoxe-", 10, alnum_or_dash),
    ("xapp-", 10, alnum_or_dash),
];

/// The end of the run of bytes satisfying `pred` from `from`.
fn run_end(b: &[u8], from: usize, pred: impl Fn(&u8) -> bool) -> usize {
    from + b[from..].iter().take_while(|c| pred(c)).count()
}

/// A prefixed token at `i`: the prefix and its body, and any letters or digits right after it
/// (so a span never ends just before one; see `scan`).
fn prefixed_at(b: &[u8], i: usize) -> Option<Range<usize>> {
    PREFIXED.iter().find_map(|&(prefix, min, body)| {
        let from = i + prefix.len();
        let found = b[i..].starts_with(prefix.as_bytes())
            && b.len() >= from + min
            && b[from..from + min].iter().all(body);
        found.then(|| i..run_end(b, run_end(b, from, body), u8::is_ascii_alphanumeric))
    })
}

/// Characters that end a bearer token in text: whitespace aside, quotes and brackets around it.
/// None of them occurs in a token (RFC 6750's b64token), and `[` starts `[REDACTED]`.
const AROUND_TOKEN: &str = "\"'`<>()[]{},;\\";

/// `scheme` (any case), whitespace, and the rest of `s` after it: `Bearer abc`, `Basic dXNl`.
fn after_scheme<'a>(s: &'a str, i: usize, scheme: &str) -> Option<&'a str> {
    let rest = &s[i..];
    let after = rest
        .get(..scheme.len())
        .filter(|word| word.eq_ignore_ascii_case(scheme))
        .map(|_| &rest[scheme.len()..])?;
    let token = after.trim_start();
    (token.len() < after.len()).then_some(token)
}

/// `Bearer`, whitespace, then a token of at least 8 characters up to whitespace, a quote or a
/// bracket: the token.
fn bearer_at(s: &str, i: usize) -> Option<Range<usize>> {
    let token = after_scheme(s, i, "bearer")?;
    let len = token
        .find(|c: char| c.is_whitespace() || AROUND_TOKEN.contains(c))
        .unwrap_or(token.len());
    let start = s.len() - token.len();
    token[..len].chars().nth(7).map(|_| start..start + len)
}

/// `Basic`, whitespace, then base64 that decodes to printable ASCII holding `user:password`
/// (something after the colon), ending at whitespace, a quote, `.,;)]}>` or the end: the
/// base64. Decoding keeps `Basic plan` or `basic authentication` out.
fn basic_at(s: &str, i: usize) -> Option<Range<usize>> {
    let token = after_scheme(s, i, "basic")?.as_bytes();
    let len = run_end(token, 0, |c| {
        c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/'
    });
    let padded = len
        + token[len..]
            .iter()
            .take(2)
            .take_while(|c| **c == b'=')
            .count();
    let ends = token
        .get(padded)
        .is_none_or(|c| c.is_ascii_whitespace() || b"\"'.,;)]}>".contains(c));
    if !ends || len % 4 == 1 {
        return None;
    }
    let (mut bits, mut held, mut colon, mut password) = (0u32, 0, false, false);
    for &c in &token[..len] {
        let sextet = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            _ => 63,
        };
        bits = (bits << 6) | u32::from(sextet);
        held += 6;
        if held >= 8 {
            held -= 8;
            let byte = (bits >> held) as u8;
            bits &= (1 << held) - 1;
            if !(b' '..=b'~').contains(&byte) {
                return None;
            }
            password |= colon;
            colon |= byte == b':';
        }
    }
    let start = s.len() - token.len();
    password.then_some(start..start + padded)
}

/// After `scheme://`, an authority's userinfo that holds a password (`user:password@host`): the
/// userinfo. The authority ends at `/`, `?`, `#`, whitespace or a quote; the userinfo at its
/// last `@`, as URL parsers read a password holding an unescaped `@`.
fn url_userinfo_at(b: &[u8], i: usize) -> Option<Range<usize>> {
    if i == 0 || !b[i - 1].is_ascii_alphanumeric() || !b[i..].starts_with(b"://") {
        return None;
    }
    let start = i + 3;
    let end = start + b[start..].iter().take_while(|c| !ends_authority(c)).count();
    let at = start + b[start..end].iter().rposition(|c| *c == b'@')?;
    let colon = start + b[start..at].iter().position(|c| *c == b':')?;
    (colon + 1 < at).then_some(start..at)
}

fn ends_authority(c: &u8) -> bool {
    *c <= b' ' || *c == 0x7f || b"/?#\"'<>`\\".contains(c)
}

/// Three base64url segments joined by dots, the first two (JSON header and claims) starting
/// `eyJ`: a signed JWT, whole.
fn jwt_at(b: &[u8], i: usize, no_jwt_before: &mut usize) -> Option<Range<usize>> {
    if i < *no_jwt_before || !b[i..].starts_with(b"eyJ") {
        return None;
    }
    let base64url = |c: &u8| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_';
    let header_end = run_end(b, i, base64url);
    // A JWT starting later in this header would have the same claims and signature: once this
    // one fails, so do they, and none is tried (the scan stays linear).
    *no_jwt_before = header_end;
    let claims = header_end + 1;
    if b.get(header_end) != Some(&b'.') || !b[claims..].starts_with(b"eyJ") {
        return None;
    }
    let claims_end = run_end(b, claims, base64url);
    if b.get(claims_end) != Some(&b'.') {
        return None;
    }
    let end = run_end(b, claims_end + 1, base64url);
    (end > claims_end + 1).then_some(i..end)
}

/// A `-----BEGIN <label>-----` line whose label ends in `PRIVATE KEY` (RSA, EC, OPENSSH,
/// ENCRYPTED, PKCS#8 ...) or is `PGP PRIVATE KEY BLOCK`: through the matching `-----END
/// <label>-----`, or to the end of the text when the block is cut off (its rest still leaks).
fn private_key_block_at(s: &str, i: usize) -> Option<Range<usize>> {
    const BEGIN: &str = "-----BEGIN ";
    const END: &str = "-----END ";
    let rest = s[i..].strip_prefix(BEGIN)?;
    let label = &rest[..rest.find(['-', '\n'])?];
    let body = i + BEGIN.len() + label.len();
    if !s[body..].starts_with("-----")
        || !(label.ends_with("PRIVATE KEY") || label.ends_with("PRIVATE KEY BLOCK"))
    {
        return None;
    }
    let mut from = body;
    while let Some(at) = s[from..].find(END) {
        from += at + END.len();
        if let Some(after) = s[from..].strip_prefix(label) {
            if after.starts_with("-----") {
                return Some(i..from + label.len() + "-----".len());
            }
        }
    }
    Some(i..s.len())
}

/// Calls `found` with the byte range of each credential in `s`, left to right and disjoint,
/// until it returns false. Token patterns must start a word (not follow an ASCII letter or
/// digit: `task-1…` or `pallbearer …` do not fire). No span ends just before an ASCII letter or
/// digit, so no pattern starts a word after a `[REDACTED]` that did not before: redacting twice
/// finds nothing new.
fn scan(s: &str, mut found: impl FnMut(Range<usize>) -> bool) {
    let b = s.as_bytes();
    let (mut i, mut next_check, mut no_jwt_before) = (0, interrupt::EVERY_BYTES, 0);
    while i < b.len() {
        if i >= next_check {
            interrupt::check();
            next_check = i + interrupt::EVERY_BYTES;
        }
        let word_start = i == 0 || !b[i - 1].is_ascii_alphanumeric();
        // `b[i]` is ASCII in every arm that slices `s`, so `i` is a char boundary there.
        let span = match b[i] {
            b'-' => private_key_block_at(s, i),
            b':' => url_userinfo_at(b, i),
            b'e' if word_start => jwt_at(b, i, &mut no_jwt_before),
            b'b' | b'B' if word_start => bearer_at(s, i).or_else(|| basic_at(s, i)),
            b'A' | b'g' | b'r' | b's' | b'x' if word_start => prefixed_at(b, i),
            _ => None,
        };
        match span {
            Some(span) => {
                let end = span.end;
                if !found(span) {
                    return;
                }
                i = end;
            }
            None => i += 1,
        }
    }
}

/// Whether `s` carries a credential the value patterns know: `Bearer <token>`, `Basic
/// <user:password in base64>`, a URL with a password, a JWT, a PEM or PGP private key block, or
/// a prefixed key or token (see `PREFIXED`). Exactly when `redact_text` would change `s`.
pub fn is_credential(s: &str) -> bool {
    let mut any = false;
    scan(s, |_| {
        any = true;
        false
    });
    any
}

/// Free text (an error message, a note, a summary, a title) as the ledger stores it: with value
/// checking on, each credential the value patterns find is replaced by `[REDACTED]` and the rest
/// of the text is kept. For `Bearer` and `Basic` the scheme stays, for a URL all but its
/// userinfo; a key block goes whole, BEGIN to END. Borrowed when nothing is found.
pub fn redact_text<'a>(rules: &Rules, s: &'a str) -> Cow<'a, str> {
    if !rules.check_values {
        return Cow::Borrowed(s);
    }
    let (mut out, mut kept) = (String::new(), 0);
    scan(s, |span| {
        out.push_str(&s[kept..span.start]);
        out.push_str(REDACTED);
        kept = span.end;
        true
    });
    if out.is_empty() {
        return Cow::Borrowed(s);
    }
    out.push_str(&s[kept..]);
    Cow::Owned(out)
}

// ---------------------------------------------------------------------------------------------
// JSON
// ---------------------------------------------------------------------------------------------

/// A secret reference: an object whose `secret_id` is a string that is not blank.
fn is_secret_ref(m: &Map<String, Value>) -> bool {
    matches!(m.get("secret_id"), Some(Value::String(id)) if !id.trim().is_empty())
}

/// `v` with the value of every sensitive key (at any depth) replaced by `"[REDACTED]"`, except
/// secret references, which are kept as `{"secret_id": id}` alone; with value checking on,
/// every string carrying a credential is replaced whole (the `secret_id` too).
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
                if !is_sensitive_key(rules, k) {
                    redact_in_place(rules, item);
                    continue;
                }
                match item {
                    // Only the reference is kept: the other members sit under a sensitive key
                    // too, and may hold the very secret the reference stands for.
                    Value::Object(reference) if is_secret_ref(reference) => {
                        reference.retain(|k, _| k == "secret_id");
                        redact_in_place(rules, item);
                    }
                    _ => *item = Value::from(REDACTED),
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
            // An acronym ends before the capital that starts the next word.
            ("APIKey", "api_key"),
            ("XAPIKey", "xapi_key"),
            ("HTTPSProxy", "https_proxy"),
            ("DBPassword", "db_password"),
            ("apiKEY", "api_key"),
            ("api2Key", "api2_key"),
            ("S3Bucket", "s3_bucket"),
            ("api.key", "api_key"),
            (" password ", "password"),
            ("__token__", "token"),
            ("api -- key", "api_key"),
            ("api_-_Key", "api_key"),
            ("secret key", "secret_key"),
            ("Set-Cookie", "set_cookie"),
            ("Proxy-Authorization", "proxy_authorization"),
            ("privateKeyId", "private_key_id"),
            // Compatibility forms fold to ASCII; invisible format characters vanish.
            ("ＰＡＳＳＷＯＲＤ", "password"),
            ("ａｐｉＫｅｙ", "api_key"),
            ("ＡＰＩ＿ＫＥＹ", "api_key"),
            ("\u{1d429}\u{1d41a}\u{1d42c}\u{1d42c}", "pass"),
            ("\u{1d7ce}\u{ff11}", "01"),
            ("pass\u{200b}word", "password"),
            ("\u{feff}token\u{200d}", "token"),
            // Other letters separate words.
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
    fn keys_of_any_length_are_read_by_meaning() {
        let fits = "a".repeat(KEY_BYTES);
        assert_eq!(norm(&fits), fits);
        assert!(normalize_key(&"a".repeat(KEY_BYTES + 1)).is_none());
        // The inserted separators count toward the size.
        assert!(normalize_key(&"aB".repeat(KEY_BYTES / 2)).is_none());
        // Punctuation that folds away does not.
        let padded = format!("{}password{}", "-".repeat(500), " ".repeat(500));
        assert_eq!(norm(&padded), "password");
        assert!(sensitive(&padded));
        // A key far too long to normalise is still read word by word.
        let long = format!("{}_db_password", "x".repeat(1 << 20));
        assert!(normalize_key(&long).is_none());
        assert!(sensitive(&long));
        assert!(sensitive(&format!("{}Password", "x".repeat(1 << 20))));
        assert!(sensitive(&format!("{}_token", "a_".repeat(1 << 19))));
        assert!(!sensitive(&format!("password_{}", "x".repeat(1 << 20))));
        assert!(sensitive(&format!("password{}", "_1".repeat(1 << 19))));
        // A name from `ledger.redact_keys` that does not fit is ignored.
        let name = format!("signature_{}", "x".repeat(KEY_BYTES));
        assert!(!is_sensitive_key(&Rules::new(Some(&name), true), &name));
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
            "passWord",
            "PassPhrase",
            "ＰＡＳＳＷＯＲＤ",
            "ｄｂ＿ｐａｓｓｗｏｒｄ",
            "\u{1d429}\u{1d41a}\u{1d42c}\u{1d42c}\u{1d430}\u{1d428}\u{1d42b}\u{1d41d}",
            "pass\u{200b}word",
            "db_password",
            "DBPassword",
            "PGPASSWORD",
            "passwords",
            "password2",
            "password_confirmation",
            "Authorization",
            "Proxy-Authorization",
            "Cookie",
            "cookies",
            "Set-Cookie",
            "auth",
            "basic_auth",
            "x-auth-token",
            "secretKey",
            "SECRET_KEY_BASE",
            "api-secret",
            "AWS_SECRET_ACCESS_KEY",
            "bearerToken",
            "id_token",
            "api_token",
            "github_token",
            "GITHUB_PAT",
            "DB_PASS",
            "passwd",
            "pwd",
            "MYSQL_PWD",
            "credentials",
            "secretAccessKey",
            "sessionToken",
            "refresh-token",
            "access_tokens",
            "token",
            "TOKEN",
            "secret",
            "secret_value",
            "private_key_pem",
            // Odd case: the case split would cut the name into pieces.
            "APIkey",
            "ApIkEy",
            "pAsSwOrD",
            "sEcReT",
            "tOkEn",
            "aUtHoRiZaTiOn",
            "x-ApIkEy",
            "db_pAsSwOrD",
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
            "input_tokens",
            "next_page_token",
            "NextToken",
            "eos_token",
            "token_type",
            "tokenizer",
            "secretary",
            "passport",
            "key",
            "keys",
            "keyword",
            "monkey",
            "primary_key",
            "public_key",
            "cache_key",
            "key_id",
            // An id names a secret, it is not one.
            "private_key_id",
            "secret_id",
            "access_key_id",
            // Where a secret is, not the secret.
            "POSTGRES_PASSWORD_FILE",
            "credentials_path",
            "author",
            "oauth",
            "OLDPWD",
            "pass",
            "password_hint",
            "session_id",
            "signature",
            "api",
            "access",
            "value",
            "2",
            // The acronym `XAPI` is not `api`; see keys_can_be_added_by_configuration.
            "XAPIKey",
            // Camel case read by words, also next to a short word.
            "nextPageToken",
            "pageToken",
            "eosToken",
            "maxTokens",
            "inputTokens",
            "primaryKey",
            "getIPAddress",
            "ioTokenCount",
            "",
            "-",
        ] {
            assert!(!sensitive(key), "{key:?}");
        }
    }

    #[test]
    fn keys_can_be_added_by_configuration() {
        let rules = Rules::new(Some(" X-Signature ,, mfaCode,  ,XAPIKey,OTP"), true);
        for key in [
            "x_signature",
            "X_SIGNATURE",
            "xSignature",
            "mfa_code",
            "MFA-Code",
            "XAPIKey",
            "xapi_key",
            "otp",
            "OTP",
        ] {
            assert!(is_sensitive_key(&rules, key), "{key:?}");
            assert!(!sensitive(key), "{key:?} is not a default");
        }
        // Names match normalised and whole, not as words.
        for key in [
            "signature",
            "x_signature_256",
            "xapikey",
            "code",
            "otp_code",
        ] {
            assert!(!is_sensitive_key(&rules, key), "{key:?}");
        }
        // The defaults stay, blank entries add nothing.
        assert!(is_sensitive_key(&rules, "password"));
        assert!(!is_sensitive_key(&rules, ""));
        assert!(!is_sensitive_key(&rules, "-"));
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
    fn secret_references_are_kept_alone() {
        let v = redacted(json!({
            "password": {"secret_id": "sec_1", "token": "x", "label": "db"},
            "api_key": {"secret_id": "sec_2"},
            "Cookie": {"secret_id": " sec_3 ", "plain": "hunter2", "provider": "vault"},
        }));
        assert_eq!(
            v,
            json!({
                "password": {"secret_id": "sec_1"},
                "api_key": {"secret_id": "sec_2"},
                "Cookie": {"secret_id": " sec_3 "},
            })
        );
        // A reference nested in a reference goes with the other members.
        let v = redacted(json!({"secret": {"secret_id": "s", "token": {"secret_id": "t"}}}));
        assert_eq!(v, json!({"secret": {"secret_id": "s"}}));
    }

    #[test]
    fn only_a_string_secret_id_with_text_is_a_reference() {
        for secret_id in [
            json!(1),
            json!(null),
            json!({"id": "s"}),
            json!(["s"]),
            json!(true),
            json!(""),
            json!(" \t\n\u{3000}"),
        ] {
            let v = redacted(json!({"password": {"secret_id": secret_id, "plain": "hunter2"}}));
            assert_eq!(v, json!({"password": REDACTED}));
        }
        // `secret_ref` (an older spelling) is not an exemption.
        let v = redacted(json!({"password": {"secret_ref": "s"}}));
        assert_eq!(v, json!({"password": REDACTED}));
        // Under a key that is not sensitive, a reference is just an object.
        let v = redacted(json!({"db": {"secret_id": "s", "pwd": "x", "host": "h"}}));
        assert_eq!(
            v,
            json!({"db": {"secret_id": "s", "pwd": REDACTED, "host": "h"}})
        );
    }

    #[test]
    fn secret_id_inside_a_reference_is_checked_as_a_value() {
        let v = redacted(json!({"token": {"secret_id": "Bearer abcdefgh12345", "x": 1}}));
        assert_eq!(v, json!({"token": {"secret_id": REDACTED}}));
        // Redacting again keeps it: "[REDACTED]" is a reference's id like any other.
        assert_eq!(redacted(v.clone()), v);
        let rules = Rules::new(None, false);
        let v = redact(
            &rules,
            json!({"token": {"secret_id": "Bearer abcdefgh12345"}}),
        );
        assert_eq!(v, json!({"token": {"secret_id": "Bearer abcdefgh12345"}}));
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
            "xoxa-1234567890",
            "xoxr-1234567890",
            "xoxs-1234567890",
            "xoxe-1-abcdefghij",
            "xapp-1-A0123-456-abcdef",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "xoxb-123456789",
            "xoxz-1234567890",
            "xapp_1234567890",
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
    fn pgp_private_key_blocks() {
        let block =
            "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQOYBF\n-----END PGP PRIVATE KEY BLOCK-----";
        assert!(is_credential(block));
        assert!(is_credential(
            "-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBF"
        ));
        assert!(!is_credential(
            "-----BEGIN PGP PUBLIC KEY BLOCK-----\nmQENBF"
        ));
        assert!(!is_credential("-----BEGIN PGP SIGNATURE-----\niQEz"));
        assert!(!is_credential("-----BEGIN PGP MESSAGE-----\nhQEM"));
    }

    #[test]
    fn stripe_keys() {
        let body = "51Hx2AbCdEfGhIjKlMnOpQr";
        for prefix in ["sk_live_", "sk_test_", "rk_live_", "rk_test_"] {
            assert!(is_credential(&format!("{prefix}{body}")), "{prefix}");
            assert!(
                is_credential(&format!("STRIPE_KEY={prefix}{body}")),
                "{prefix}"
            );
            assert!(
                !is_credential(&format!("{prefix}{}", &body[..15])),
                "{prefix}"
            );
            assert!(!is_credential(&format!("risk{prefix}{body}")), "{prefix}");
        }
        // Publishable keys are public: web pages embed them.
        assert!(!is_credential(&format!("pk_live_{body}")));
        assert!(!is_credential(&format!("pk_test_{body}")));
        assert!(!is_credential(&format!("sk_prod_{body}")));
    }

    #[test]
    fn aws_temporary_key_ids() {
        assert!(is_credential("ASIAIOSFODNN7EXAMPLE"));
        assert!(is_credential("id ASIAIOSFODNN7EXAMPLE, secret ..."));
        assert!(!is_credential("ASIAN-FOOD-RECIPES-2024"));
        assert!(!is_credential("ASIA"));
        assert!(!is_credential("EURASIAIOSFODNN7EXAMPLE"));
    }

    #[test]
    fn github_fine_grained_and_gitlab_tokens() {
        let pat = format!(
            "github_pat_11ABCDEFG0{}_{}",
            "a1".repeat(6),
            "Zz9".repeat(20)
        );
        assert!(is_credential(&pat));
        assert!(is_credential("github_pat_abcdefghijklmnopqrstuv"));
        assert!(!is_credential("github_pat_abcdefghijklmnopqrstu"));
        assert!(!is_credential("github_pat_"));
        assert!(!is_credential("see github_pat_ docs"));
        for prefix in [
            "glpat-", "gloas-", "gldt-", "glrt-", "glrtr-", "glcbt-", "glptt-", "glft-", "glimt-",
            "glagent-", "glsoat-", "glffct-",
        ] {
            let token = format!("{prefix}z_sxgtrfAxKr8q1TPY8Y");
            assert!(is_credential(&token), "{token}");
            assert!(is_credential(&format!("PRIVATE-TOKEN: {token}")), "{token}");
            assert!(
                !is_credential(&token[..token.len() - 1]),
                "{token}: 19 characters"
            );
            assert!(!is_credential(&format!("x{token}")), "{token}");
        }
        assert!(!is_credential("glxyz-z_sxgtrfAxKr8q1TPY8Y"));
        assert!(!is_credential("glpat_z_sxgtrfAxKr8q1TPY8Y"));
    }

    const JWT: &str =
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSIsImV4cCI6MX0.c2lnbmF0dXJlLWJ5dGVz_-x";

    #[test]
    fn jwts() {
        for s in [
            JWT.to_owned(),
            format!("token={JWT}&x=1"),
            format!("\"{JWT}\""),
            "eyJa.eyJb.c".to_owned(),
        ] {
            assert!(is_credential(&s), "{s:?}");
        }
        for s in [
            "eyJ",
            "eyJhbGciOiJIUzI1NiJ9",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9",
            // Unsigned: nothing secret in it.
            "eyJhbGciOiJub25lIn0.eyJzdWIiOiJhbGljZSJ9.",
            "eyJhbGciOiJIUzI1NiJ9.e30.c2ln",
            "xeyJa.eyJb.c",
            "EYJa.eyJb.c",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn basic_authorization() {
        for s in [
            // user:pass, aladdin:opensesame, a:b (unpadded).
            "Basic dXNlcjpwYXNz",
            "Authorization: Basic YWxhZGRpbjpvcGVuc2VzYW1l",
            "basic\tYWxhZGRpbjpvcGVuc2VzYW1l",
            "BASIC YTpi",
            "(Basic YTpi)",
            "\"Basic dXNlcjpwYXNz\",",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "Basic plan",
            "Basic plan: 10 seats",
            "basic authentication is discouraged",
            "Basic usage of the API",
            "the basic idea",
            "Basic",
            "Basic ",
            // No colon (user only), nothing after the colon, not printable.
            "Basic dXNlcg==",
            "Basic dXNlcjo=",
            "Basic //79/Q==",
            // Not base64 up to its end.
            "Basic dXNlcjpwYXNz-x",
            "Basic dXNlcjpwYXNz[x]",
            "Basic dXNlcjpwYXNzQ",
            "xBasic dXNlcjpwYXNz",
        ] {
            assert!(!is_credential(s), "{s:?}");
        }
    }

    #[test]
    fn urls_with_a_password() {
        for s in [
            "postgres://app:s3cret@db/x",
            "https://user:pass@example.com",
            "DATABASE_URL=postgresql://app:p@ss@db:5432/x?sslmode=require",
            "redis://:hunter2@cache:6379/0",
            "see mysql://root:toor@localhost.",
            "amqp://guest:guest@rabbit",
        ] {
            assert!(is_credential(s), "{s:?}");
        }
        for s in [
            "https://example.com/a@b",
            "https://example.com/a:b@c",
            "https://example.com?u=a:b@c",
            "https://user@example.com",
            "https://user:@example.com",
            "ssh://git@github.com/org/repo.git",
            "git@github.com:org/repo.git",
            "mailto:alice@example.com",
            "alice@example.com",
            "user:pass@host",
            "://user:pass@host",
            "http://[::1]:8080/x",
            "postgres://db:5432/x",
            "https://abc123@o1.ingest.sentry.io/1",
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
            "the bearer of bad news",
            "Basic plan",
            "550e8400-e29b-41d4-a716-446655440000",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk",
            "v1.2.3-rc.1+build.5",
            "sk-1",
            "desk-lamp-with-a-very-long-product-name",
            "eyJ",
            "AKIA is a prefix",
            "https://example.com/path?q=1#frag",
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

    fn text(s: &str) -> Cow<'_, str> {
        redact_text(&Rules::default(), s)
    }

    #[test]
    fn free_text_loses_only_the_credentials() {
        for (s, want) in [
            (
                "upstream said 401 for Authorization: Bearer abcdefgh12345678 at https://bob:pw@api.x/y",
                "upstream said 401 for Authorization: Bearer [REDACTED] at https://[REDACTED]@api.x/y",
            ),
            ("header \"Bearer abcdefgh\", then", "header \"Bearer [REDACTED]\", then"),
            ("Basic YWxhZGRpbjpvcGVuc2VzYW1l.", "Basic [REDACTED]."),
            (
                "keys: sk-abcdefghijklmnopqrstuvwxyz, AKIAIOSFODNN7EXAMPLEabc and ok",
                "keys: [REDACTED], [REDACTED] and ok",
            ),
            (&format!("jwt {JWT}; done"), "jwt [REDACTED]; done"),
            (
                "key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\nafter",
                "key:\n[REDACTED]\nafter",
            ),
            (
                "two\n-----BEGIN PRIVATE KEY-----\na\n-----END PRIVATE KEY-----\n-----BEGIN EC PRIVATE KEY-----\nb",
                "two\n[REDACTED]\n[REDACTED]",
            ),
            // A block cut off goes to the end; an END of another label does not close it.
            (
                "x -----BEGIN PRIVATE KEY-----\nabc\n-----END RSA PRIVATE KEY-----\ntail",
                "x [REDACTED]",
            ),
            ("dsn postgres://app:p@ss@db/x ok", "dsn postgres://[REDACTED]@db/x ok"),
            ("xoxb-1234567890", "[REDACTED]"),
        ] {
            assert_eq!(text(s), want, "{s:?}");
            assert!(is_credential(s), "{s:?}");
            assert!(!is_credential(want), "{want:?}");
            assert_eq!(text(want), want, "{want:?}");
        }
    }

    #[test]
    fn free_text_without_credentials_is_borrowed() {
        for s in [
            "",
            "plain words",
            "the bearer of bad news",
            "https://example.com/a@b",
        ] {
            assert!(matches!(text(s), Cow::Borrowed(b) if b == s), "{s:?}");
        }
        let off = Rules::new(None, false);
        let s = "Bearer abcdefgh12345678";
        assert!(matches!(redact_text(&off, s), Cow::Borrowed(b) if b == s));
        assert_eq!(text(s), "Bearer [REDACTED]");
    }

    #[test]
    fn free_text_of_any_length_is_scanned_linearly() {
        // Near misses repeated across megabytes: each would rescan the rest if the scan
        // backtracked. These finish in milliseconds.
        for unit in [
            "eyJa-",
            "eyJa.eyJb..",
            "basic a+",
            "Bearer ",
            "x://a@",
            "-----BEGIN X",
        ] {
            let s = unit.repeat((1 << 20) / unit.len());
            assert!(!is_credential(&s), "{unit:?}");
        }
        let s = format!("{}Bearer abcdefgh", " ".repeat(1 << 20));
        assert_eq!(text(&s).len(), (1 << 20) + "Bearer [REDACTED]".len());
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
