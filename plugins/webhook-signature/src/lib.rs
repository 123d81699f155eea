//! Verifies a git provider's webhook signature before the event reaches an
//! event source.
//!
//! - `github`: `X-Hub-Signature-256: sha256=<hex>`, the HMAC-SHA256 of the
//!   raw body with the webhook secret;
//! - `bitbucket-server`: `X-Hub-Signature: sha256=<hex>`, the same HMAC;
//! - `gitlab`: `X-Gitlab-Token`, the secret itself.
//!
//! Comparisons are constant-time. For the HMAC modes the plugin reads the
//! body (up to `max_body`, 25 MiB by default: GitHub's own cap), and the
//! proxy forwards exactly the bytes that were verified.

use hmac::{Hmac, Mac};
use portcullis_sdk::{Decision, Plugin, RequestHead, RouteInfo};
use serde::Deserialize;
use sha2::Sha256;
use subtle::ConstantTimeEq;

#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Provider {
    Github,
    Gitlab,
    BitbucketServer,
}

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    provider: Provider,
    secret: String,
    #[serde(default = "default_max_body")]
    max_body: u32,
}

fn default_max_body() -> u32 {
    25 * 1024 * 1024
}

/// Checks `sha256=<hex>` against the HMAC-SHA256 of `body`.
pub fn hmac_matches(secret: &[u8], body: &[u8], header: &[u8]) -> bool {
    let Some(hex_sig) = header.strip_prefix(b"sha256=") else {
        return false;
    };
    let Ok(expected) = hex::decode(hex_sig) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else {
        return false;
    };
    mac.update(body);
    // verify_slice compares in constant time.
    mac.verify_slice(&expected).is_ok()
}

struct WebhookSignature;

impl Plugin for WebhookSignature {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        if c.secret.is_empty() {
            return Err(
                "`secret` is empty; set the webhook secret (for example from ${WEBHOOK_SECRET})"
                    .into(),
            );
        }
        Ok(())
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        body: Option<&[u8]>,
    ) -> Decision {
        let header_name = match c.provider {
            Provider::Github => "x-hub-signature-256",
            Provider::BitbucketServer => "x-hub-signature",
            Provider::Gitlab => {
                let ok = req
                    .header("x-gitlab-token")
                    .is_some_and(|t| bool::from(t.ct_eq(c.secret.as_bytes())));
                return if ok {
                    portcullis_sdk::forward()
                } else {
                    reject("missing or wrong X-Gitlab-Token")
                };
            }
        };
        let Some(signature) = req.header(header_name) else {
            return reject(&format!("missing {header_name}"));
        };
        match body {
            None => portcullis_sdk::read_body(c.max_body),
            Some(body) if hmac_matches(c.secret.as_bytes(), body, &signature) => {
                portcullis_sdk::count("verified", 1);
                portcullis_sdk::forward()
            }
            Some(_) => reject("signature does not match the body"),
        }
    }
}

fn reject(why: &str) -> Decision {
    portcullis_sdk::count("rejected", 1);
    portcullis_sdk::log(
        portcullis_sdk::Level::Info,
        &format!("webhook rejected: {why}"),
    );
    portcullis_sdk::respond(401, "invalid webhook signature")
}

portcullis_sdk::plugin!(WebhookSignature);

#[cfg(test)]
mod tests {
    use super::hmac_matches;

    // From GitHub's documentation on validating webhook deliveries.
    const SECRET: &[u8] = b"It's a Secret to Everybody";
    const BODY: &[u8] = b"Hello, World!";
    const SIG: &[u8] = b"sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

    #[test]
    fn github_documented_example_verifies() {
        assert!(hmac_matches(SECRET, BODY, SIG));
    }

    #[test]
    fn tampered_body_or_bad_header_fails() {
        assert!(!hmac_matches(SECRET, b"Hello, World?", SIG));
        assert!(!hmac_matches(SECRET, BODY, b"sha1=757107ea"));
        assert!(!hmac_matches(SECRET, BODY, b"sha256=zz"));
        assert!(!hmac_matches(b"other secret", BODY, SIG));
    }
}
