//! SHA-256 in lowercase hex, the form every recorded hash takes.

use sha2::{Digest, Sha256};

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

/// The NOTIFY channel of a run: a digest of its scope and id, so that it fits a channel name
/// (63 bytes) whatever the id's length and says nothing about the run to other listeners.
pub fn run_channel(tenant: &str, workspace: &str, run_id: &str) -> String {
    format!(
        "{RUN_CHANNEL_PREFIX}{}",
        hex(&run_channel_digest(tenant, workspace, run_id))
    )
}

pub const RUN_CHANNEL_PREFIX: &str = "ledger_run_";

/// The 16 bytes of a run's channel name (`run_channel` is their hex).
pub fn run_channel_digest(tenant: &str, workspace: &str, run_id: &str) -> [u8; 16] {
    let mut material = Vec::with_capacity(tenant.len() + workspace.len() + run_id.len() + 2);
    for (i, part) in [tenant, workspace, run_id].iter().enumerate() {
        if i > 0 {
            material.push(0);
        }
        material.extend_from_slice(part.as_bytes());
    }
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&Sha256::digest(&material)[..16]);
    digest
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let c = run_channel("t1", "w1", &"r".repeat(128));
        assert!(c.len() <= 63);
        assert_eq!(c, run_channel("t1", "w1", &"r".repeat(128)));
        assert_ne!(run_channel("t1", "w1", "r"), run_channel("t2", "w1", "r"));
        // The separator keeps ("ab","c") and ("a","bc") apart.
        assert_ne!(run_channel("ab", "c", "r"), run_channel("a", "bc", "r"));
    }
}
