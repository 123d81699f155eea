//! Session-ticket keys read from files (a listener's
//! `tls.session_ticket_keys`, nginx's `ssl_session_ticket_key`): replicas
//! behind one balancer that share the files resume each other's
//! sessions, where each process's own random key (the default) makes a
//! client that lands on another replica, or returns after a rollout, pay
//! a full handshake.
//!
//! The first key seals new tickets; every key opens them, so a rotation
//! puts the new key first and keeps the old one second for a ticket
//! lifetime. A ticket is ChaCha20-Poly1305 under a key derived from the
//! file, with a random nonce. The listener's context is bound in as
//! associated data: its name and client-certificate rules. A ticket
//! from a listener that asked for no client certificate therefore never
//! resumes on one that requires one, even when both use the same files
//! (rustls checks the cipher suite and server name on resumption, not
//! how the client was authenticated).

use std::path::PathBuf;

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

/// The least key material a file must hold: 32 random bytes.
pub const MIN_KEY_BYTES: usize = 32;
/// The lifetime clients are told, as rustls' own ticketer's.
const LIFETIME_SECS: u32 = 6 * 3600;
/// Key id (4) + nonce (12) before the sealed ticket; tag (16) after.
const ID_LEN: usize = 4;
const TAG_LEN: usize = 16;

/// Tickets sealed with keys from files, for one listener.
pub struct FileTicketer {
    keys: Vec<TicketKey>,
    /// The listener's context, bound into every ticket.
    context: [u8; 32],
    rng: SystemRandom,
}

struct TicketKey {
    id: [u8; ID_LEN],
    key: LessSafeKey,
}

impl std::fmt::Debug for FileTicketer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileTicketer")
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl FileTicketer {
    /// The keys in `files` (each at least [`MIN_KEY_BYTES`]), for the
    /// listener whose name and client-certificate rules `context` digests.
    /// Also returns a digest of the keys, so that a rotation shows as a
    /// changed configuration. An error names the file.
    pub fn from_files(
        files: &[PathBuf],
        context: [u8; 32],
    ) -> Result<(FileTicketer, [u8; 32]), String> {
        let mut keys = Vec::with_capacity(files.len());
        let mut all = Sha256::new();
        for file in files {
            let material = crate::files::read_bounded(file, crate::files::SMALL_LIMIT)
                .map_err(|e| format!("cannot read session ticket key {}: {e}", file.display()))?;
            if material.len() < MIN_KEY_BYTES {
                return Err(format!(
                    "session ticket key {} holds {} bytes; it needs at least {MIN_KEY_BYTES} random bytes (`openssl rand 80 > {}`)",
                    file.display(),
                    material.len(),
                    file.display()
                ));
            }
            let secret: [u8; 32] = Sha256::new()
                .chain_update(b"portcullis session ticket key\0")
                .chain_update(&material)
                .finalize()
                .into();
            let id: [u8; 32] = Sha256::digest(secret).into();
            let unbound = UnboundKey::new(&CHACHA20_POLY1305, &secret)
                .map_err(|_| "ChaCha20-Poly1305 key".to_owned())?;
            all.update(secret);
            keys.push(TicketKey {
                id: [id[0], id[1], id[2], id[3]],
                key: LessSafeKey::new(unbound),
            });
        }
        if keys.is_empty() {
            return Err("session_ticket_keys lists no file".to_owned());
        }
        Ok((
            FileTicketer {
                keys,
                context,
                rng: SystemRandom::new(),
            },
            all.finalize().into(),
        ))
    }

    fn aad(&self, id: &[u8]) -> [u8; ID_LEN + 32] {
        let mut aad = [0u8; ID_LEN + 32];
        aad[..ID_LEN].copy_from_slice(id);
        aad[ID_LEN..].copy_from_slice(&self.context);
        aad
    }
}

impl rustls::server::ProducesTickets for FileTicketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        LIFETIME_SECS
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let sealing = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(ID_LEN + NONCE_LEN + plain.len() + TAG_LEN);
        out.extend_from_slice(&sealing.id);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let aad = self.aad(&sealing.id);
        let tag = sealing
            .key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad),
                &mut out[ID_LEN + NONCE_LEN..],
            )
            .ok()?;
        out.extend_from_slice(tag.as_ref());
        Some(out)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        // Attacker-controlled bytes: every length checked, nothing panics.
        if cipher.len() < ID_LEN + NONCE_LEN + TAG_LEN {
            return None;
        }
        let (id, rest) = cipher.split_at(ID_LEN);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let key = self.keys.iter().find(|k| k.id == id)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = sealed.to_vec();
        let aad = self.aad(id);
        let plain = key
            .key
            .open_in_place(nonce, Aad::from(&aad), &mut buf)
            .ok()?;
        let len = plain.len();
        buf.truncate(len);
        Some(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::server::ProducesTickets;

    fn key_file(dir: &tempfile::TempDir, name: &str, byte: u8, len: usize) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, vec![byte; len]).unwrap();
        path
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (key_file(&dir, "old", 1, 80), key_file(&dir, "new", 2, 48));
        let (before, _) = FileTicketer::from_files(std::slice::from_ref(&old), [7; 32]).unwrap();
        let (rotated, _) = FileTicketer::from_files(&[new.clone(), old], [7; 32]).unwrap();
        let (only_new, _) = FileTicketer::from_files(&[new], [7; 32]).unwrap();
        let ticket = before.encrypt(b"session state").unwrap();
        // Another process with the same files opens it; after the
        // rotation too, until the old key is dropped.
        assert_eq!(
            rotated.decrypt(&ticket).as_deref(),
            Some(&b"session state"[..])
        );
        assert_eq!(only_new.decrypt(&ticket), None);
        let fresh = rotated.encrypt(b"newer").unwrap();
        assert_eq!(only_new.decrypt(&fresh).as_deref(), Some(&b"newer"[..]));
        // Two tickets of the same state differ (random nonces).
        assert_ne!(rotated.encrypt(b"x"), rotated.encrypt(b"x"));
    }

    #[test]
    fn another_listeners_context_or_a_changed_byte_opens_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let key = key_file(&dir, "k", 3, 32);
        let (open, _) = FileTicketer::from_files(std::slice::from_ref(&key), [0; 32]).unwrap();
        let (mutual, _) = FileTicketer::from_files(&[key], [1; 32]).unwrap();
        let ticket = open.encrypt(b"no client certificate").unwrap();
        assert_eq!(mutual.decrypt(&ticket), None);
        for i in 0..ticket.len() {
            let mut bent = ticket.clone();
            bent[i] ^= 0x40;
            assert_eq!(open.decrypt(&bent), None, "byte {i}");
        }
        for len in 0..ID_LEN + NONCE_LEN + TAG_LEN {
            assert_eq!(open.decrypt(&ticket[..len.min(ticket.len())]), None);
        }
    }

    #[test]
    fn short_or_missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let short = key_file(&dir, "short", 1, 16);
        let err = FileTicketer::from_files(&[short], [0; 32]).unwrap_err();
        assert!(
            err.contains("holds 16 bytes") && err.contains("openssl rand 80"),
            "{err}"
        );
        let err = FileTicketer::from_files(&[dir.path().join("none")], [0; 32]).unwrap_err();
        assert!(err.contains("cannot read session ticket key"), "{err}");
    }
}
