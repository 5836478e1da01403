//! SHA-256 in lowercase hex, the form every recorded hash takes; and the keyed names of the run
//! channels.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::{LedgerError, Result};

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lowercase hex of a digest.
pub fn hex(digest: &[u8]) -> String {
    let mut out = String::with_capacity(2 * digest.len());
    for b in digest {
        out.push(char::from_digit((b >> 4) as u32, 16).unwrap_or('0'));
        out.push(char::from_digit((b & 0xf) as u32, 16).unwrap_or('0'));
    }
    out
}

pub const RUN_CHANNEL_PREFIX: &str = "ledger_run_";

/// Bytes of a database's channel key (`ledger.channel_key`).
pub const CHANNEL_KEY_BYTES: usize = 32;

/// The secret a database's run channels are keyed with, ready to use: the HMAC state after the
/// key, so that a channel costs only the blocks of its own name. Any role may LISTEN on any
/// channel; without the key (readable by `ledger_owner` only) a channel cannot be computed from
/// a run's public names. No `Debug`: the key is never printed.
#[derive(Clone)]
pub struct ChannelKey(Hmac<Sha256>);

impl ChannelKey {
    pub fn new(secret: &[u8]) -> Result<ChannelKey> {
        if secret.len() != CHANNEL_KEY_BYTES {
            return Err(LedgerError::internal(format!(
                "ledger.channel_key holds a key of {} bytes, not {CHANNEL_KEY_BYTES}",
                secret.len()
            )));
        }
        Hmac::<Sha256>::new_from_slice(secret)
            .map(ChannelKey)
            .map_err(|_| LedgerError::internal("the channel key was refused by HMAC"))
    }

    /// The NOTIFY channel of a run: `ledger_run_` and the hex of `digest`, 43 bytes whatever the
    /// id's length (a channel name has at most 63).
    pub fn run_channel(&self, tenant: &str, workspace: &str, run_id: &str) -> String {
        format!(
            "{RUN_CHANNEL_PREFIX}{}",
            hex(&self.digest(tenant, workspace, run_id))
        )
    }

    /// The 16 bytes of a run's channel name: HMAC-SHA-256 of tenant, workspace and run id,
    /// NUL-separated (no id holds a NUL), cut to 128 bits.
    pub fn digest(&self, tenant: &str, workspace: &str, run_id: &str) -> [u8; 16] {
        let mut mac = self.0.clone();
        mac.update(tenant.as_bytes());
        mac.update(&[0]);
        mac.update(workspace.as_bytes());
        mac.update(&[0]);
        mac.update(run_id.as_bytes());
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&mac.finalize().into_bytes()[..16]);
        digest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; CHANNEL_KEY_BYTES] = [7; CHANNEL_KEY_BYTES];

    fn key(secret: &[u8]) -> ChannelKey {
        ChannelKey::new(secret).unwrap()
    }

    #[test]
    fn sha256_of_known_vectors() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn channels_fit_and_separate_scopes() {
        let k = key(&KEY);
        let c = k.run_channel("t1", "w1", &"r".repeat(128));
        assert!(c.len() <= 63);
        assert_eq!(c, k.run_channel("t1", "w1", &"r".repeat(128)));
        assert_ne!(
            k.run_channel("t1", "w1", "r"),
            k.run_channel("t2", "w1", "r")
        );
        // The separator keeps ("ab","c") and ("a","bc") apart.
        assert_ne!(k.run_channel("ab", "c", "r"), k.run_channel("a", "bc", "r"));
    }

    /// Without the key, a channel cannot be computed: 0.4.0's unkeyed digest of the same names
    /// is not it, and another database's key gives another channel.
    #[test]
    fn channels_depend_on_the_key() {
        let unkeyed = sha256_hex(b"acme\0support\0order-4f05");
        let keyed = key(&KEY).run_channel("acme", "support", "order-4f05");
        assert_ne!(keyed, format!("{RUN_CHANNEL_PREFIX}{}", &unkeyed[..32]));
        assert_ne!(
            keyed,
            key(&[8; CHANNEL_KEY_BYTES]).run_channel("acme", "support", "order-4f05")
        );
    }

    /// The digest is HMAC-SHA-256 (RFC 2104), checked against the definition written out.
    #[test]
    fn the_digest_is_hmac_sha256() {
        let mut inner = Sha256::new();
        inner.update(KEY.map(|b| b ^ 0x36));
        inner.update([0x36; 32]);
        inner.update(b"t\0w\0r");
        let mut outer = Sha256::new();
        outer.update(KEY.map(|b| b ^ 0x5c));
        outer.update([0x5c; 32]);
        outer.update(inner.finalize());
        assert_eq!(key(&KEY).digest("t", "w", "r"), outer.finalize()[..16]);
    }

    #[test]
    fn a_key_of_another_length_is_refused() {
        for secret in [&[][..], &[1; 16], &[1; 33]] {
            assert!(ChannelKey::new(secret).is_err());
        }
    }
}
