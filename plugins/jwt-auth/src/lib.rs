//! Bearer JWT authentication.
//!
//! Verifies `Authorization: Bearer <jwt>` signed with HS256 (a shared
//! secret), RS256 or ES256 (keys from a JWKS in the config, chosen by `kid`
//! when the token names one), then checks `exp` and `nbf` (with leeway),
//! `iss` and `aud` when configured, and can copy chosen claims into request
//! headers for the upstream. Failures answer 401 with `WWW-Authenticate`.
//! Tokens that passed are remembered (see [`cache`]), so a client's token
//! is verified once, not on every request.

mod cache;

use std::cell::{OnceCell, RefCell};
use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, Mac};
use portcullis_sdk::{Decision, HeaderEdits, Plugin, RequestHead, RouteInfo, bearer, header};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// One key of a JSON Web Key Set (RFC 7517), as written; only what
/// verification needs.
#[derive(Deserialize)]
struct Jwk {
    kty: String,
    kid: Option<String>,
    alg: Option<String>,
    // RSA
    n: Option<String>,
    e: Option<String>,
    // EC
    crv: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

#[derive(Deserialize)]
struct Jwks {
    keys: Vec<Jwk>,
}

/// A JWKS key decoded once, when the config is read: a key that cannot
/// be used is reported by `portcullis check` and at load, not found out
/// request by request, and a token signed with it costs the signature
/// check only.
pub struct Key {
    kid: Option<String>,
    alg: Option<String>,
    public: Public,
}

enum Public {
    Rsa(rsa::RsaPublicKey),
    Ec(p256::ecdsa::VerifyingKey),
}

impl Jwk {
    fn decode(self) -> Result<Key, String> {
        let field = |name: &str, value: &Option<String>| {
            let text = value
                .as_deref()
                .ok_or_else(|| format!("`{name}` is missing"))?;
            B64.decode(text)
                .map_err(|_| format!("`{name}` is not base64url"))
        };
        let public = match self.kty.as_str() {
            "RSA" => {
                let n = rsa::BigUint::from_bytes_be(&field("n", &self.n)?);
                let e = rsa::BigUint::from_bytes_be(&field("e", &self.e)?);
                Public::Rsa(
                    rsa::RsaPublicKey::new(n, e)
                        .map_err(|e| format!("not a usable RSA public key: {e}"))?,
                )
            }
            "EC" if self.crv.as_deref() == Some("P-256") => {
                let (x, y) = (field("x", &self.x)?, field("y", &self.y)?);
                if x.len() != 32 || y.len() != 32 {
                    return Err("`x` and `y` must be 32 bytes each for P-256".into());
                }
                let point = p256::EncodedPoint::from_affine_coordinates(
                    x.as_slice().into(),
                    y.as_slice().into(),
                    false,
                );
                Public::Ec(
                    p256::ecdsa::VerifyingKey::from_encoded_point(&point)
                        .map_err(|_| "`x`, `y` is not a point on P-256".to_owned())?,
                )
            }
            other => {
                return Err(format!(
                    "unsupported key (kty `{other}`): use RSA, or EC on P-256"
                ));
            }
        };
        Ok(Key {
            kid: self.kid,
            alg: self.alg,
            public,
        })
    }
}

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// HS256 shared secret.
    hs256_secret: Option<String>,
    /// A JWKS document (as an object, or as JSON text) for RS256/ES256.
    jwks: Option<Value>,
    issuer: Option<String>,
    /// Accepted audiences; the token's `aud` must contain one.
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default = "default_leeway")]
    leeway_secs: u64,
    /// Claim name → request header to set (string, number or bool claims).
    #[serde(default)]
    claims_to_headers: BTreeMap<String, String>,
    /// Answer 401 without a token (default), or let tokenless requests on.
    #[serde(default = "yes")]
    required: bool,
    /// How many verified tokens each instance remembers (0: verify every
    /// request).
    #[serde(default = "default_cache_size")]
    cache_size: usize,
}

fn default_cache_size() -> usize {
    256
}

fn default_leeway() -> u64 {
    30
}

fn yes() -> bool {
    true
}

impl Config {
    fn parsed_keys(&self) -> Result<Vec<Key>, String> {
        let Some(jwks) = &self.jwks else {
            return Ok(Vec::new());
        };
        let doc: Jwks = match jwks {
            Value::String(text) => serde_json::from_str(text),
            other => serde_json::from_value(other.clone()),
        }
        .map_err(|e| format!("`jwks` is not a JWKS document: {e}"))?;
        doc.keys
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                let which = match &k.kid {
                    Some(kid) => format!("JWKS key {} (kid `{kid}`)", i + 1),
                    None => format!("JWKS key {}", i + 1),
                };
                k.decode().map_err(|e| format!("{which}: {e}"))
            })
            .collect()
    }
}

/// Why a token was refused (shown in logs, not to the client).
#[derive(Debug, PartialEq)]
pub enum Refusal {
    Malformed,
    Algorithm(String),
    NoKey,
    Signature,
    Expired,
    NotYetValid,
    Issuer,
    Audience,
}

fn b64(part: &str) -> Result<Vec<u8>, Refusal> {
    B64.decode(part).map_err(|_| Refusal::Malformed)
}

/// Verifies `token` against `config` at `now` (seconds); returns the claims.
pub fn verify(
    config: &Config,
    keys: &[Key],
    token: &str,
    now: u64,
) -> Result<serde_json::Map<String, Value>, Refusal> {
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Refusal::Malformed);
    };
    let header: Value = serde_json::from_slice(&b64(h)?).map_err(|_| Refusal::Malformed)?;
    let signature = b64(s)?;
    let signed = &token.as_bytes()[..h.len() + 1 + p.len()];
    let alg = header["alg"].as_str().unwrap_or("");
    let kid = header["kid"].as_str();
    let pick = |rsa: bool| {
        keys.iter()
            .filter(|k| matches!(k.public, Public::Rsa(_)) == rsa)
            .filter(|k| k.alg.as_deref().is_none_or(|a| a == alg))
            .find(|k| kid.is_none() || k.kid.as_deref() == kid)
            .ok_or(Refusal::NoKey)
    };
    match alg {
        "HS256" => {
            let secret = config.hs256_secret.as_deref().ok_or(Refusal::NoKey)?;
            let mut mac =
                Hmac::<Sha256>::new_from_slice(secret.as_bytes()).map_err(|_| Refusal::NoKey)?;
            mac.update(signed);
            mac.verify_slice(&signature)
                .map_err(|_| Refusal::Signature)?;
        }
        "RS256" => {
            let Public::Rsa(key) = &pick(true)?.public else {
                return Err(Refusal::NoKey);
            };
            let digest = Sha256::digest(signed);
            key.verify(rsa::Pkcs1v15Sign::new::<Sha256>(), &digest, &signature)
                .map_err(|_| Refusal::Signature)?;
        }
        "ES256" => {
            use p256::ecdsa::signature::Verifier;
            let Public::Ec(key) = &pick(false)?.public else {
                return Err(Refusal::NoKey);
            };
            // JWS carries ES256 signatures as raw r||s (64 bytes).
            let sig =
                p256::ecdsa::Signature::from_slice(&signature).map_err(|_| Refusal::Signature)?;
            key.verify(signed, &sig).map_err(|_| Refusal::Signature)?;
        }
        // "none" and anything else: refused, whatever the token claims.
        other => return Err(Refusal::Algorithm(other.to_owned())),
    }
    let claims: serde_json::Map<String, Value> =
        serde_json::from_slice(&b64(p)?).map_err(|_| Refusal::Malformed)?;
    times(&claims).check_time(now, config.leeway_secs)?;
    if let Some(iss) = &config.issuer
        && claims.get("iss").and_then(Value::as_str) != Some(iss)
    {
        return Err(Refusal::Issuer);
    }
    if !bearer::audience_ok(claims.get("aud"), &config.audiences) {
        return Err(Refusal::Audience);
    }
    Ok(claims)
}

/// The token's time claims, for [`cache::Verified::check_time`].
fn times(claims: &serde_json::Map<String, Value>) -> cache::Verified {
    cache::Verified {
        exp: claims.get("exp").and_then(Value::as_u64),
        nbf: claims.get("nbf").and_then(Value::as_u64),
        edits: portcullis_sdk::no_edits(),
    }
}

/// Verifies `token` once; later requests with the same token are served
/// from this instance's cache, with their time claims checked again.
fn decide(config: &Config, token: &[u8], now: u64) -> Result<HeaderEdits, Refusal> {
    CACHE.with(|cell| {
        let mut cache = cell
            .get_or_init(|| RefCell::new(cache::TokenCache::new(config.cache_size)))
            .borrow_mut();
        match cache.get(token, now, config.leeway_secs) {
            Some(decided) => decided,
            None => verify_and_keep(config, &mut cache, token, now),
        }
    })
}

thread_local! {
    static CACHE: OnceCell<RefCell<cache::TokenCache>> = const { OnceCell::new() };
}

/// A cache miss: the full verification, out of line. Inlined, it made the
/// hit, which nearly every request takes, spill more registers: ~70
/// guest instructions per call (callgrind).
#[cold]
#[inline(never)]
fn verify_and_keep(
    config: &Config,
    cache: &mut cache::TokenCache,
    token: &[u8],
    now: u64,
) -> Result<HeaderEdits, Refusal> {
    let text = std::str::from_utf8(token).map_err(|_| Refusal::Malformed)?;
    let claims = verify(config, keys(config), text, now)?;
    let verified = cache::Verified {
        edits: bearer::claim_edits(&config.claims_to_headers, &claims),
        ..times(&claims)
    };
    let edits = verified.edits.clone();
    cache.insert(token, verified, now, config.leeway_secs);
    Ok(edits)
}

struct JwtAuth;

impl Plugin for JwtAuth {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        let keys = c.parsed_keys()?;
        if c.hs256_secret.as_deref().is_none_or(str::is_empty) && keys.is_empty() {
            return Err("give `hs256_secret` or `jwks` (or both)".into());
        }
        Ok(())
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _body: Option<&[u8]>,
    ) -> Decision {
        let authorization = req.header("authorization");
        let Some(token) = authorization.as_deref().and_then(bearer::token) else {
            return if c.required {
                unauthorized("missing bearer token")
            } else {
                portcullis_sdk::forward_with(bearer::anonymous_edits(&c.claims_to_headers))
            };
        };
        match decide(c, token, portcullis_sdk::now_unix_ms() / 1000) {
            Ok(edits) => portcullis_sdk::forward_with(edits),
            Err(why) => refused(why),
        }
    }
}

/// The config's keys, decoded once per instance.
fn keys(c: &Config) -> &'static [Key] {
    static KEYS: std::sync::OnceLock<Vec<Key>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| c.parsed_keys().unwrap_or_default())
}

#[cold]
#[inline(never)]
fn refused(why: Refusal) -> Decision {
    unauthorized(&format!("{why:?}"))
}

#[cold]
#[inline(never)]
fn unauthorized(why: &str) -> Decision {
    portcullis_sdk::count("refused", 1);
    portcullis_sdk::log(portcullis_sdk::Level::Debug, &format!("jwt refused: {why}"));
    match portcullis_sdk::respond(401, "invalid or missing bearer token") {
        Decision::Respond(mut r) => {
            r.headers.push(header("www-authenticate", "Bearer"));
            Decision::Respond(r)
        }
        other => other,
    }
}

portcullis_sdk::plugin!(JwtAuth);

#[cfg(test)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::Signer;

    fn config(json: Value) -> (Config, Vec<Key>) {
        let c: Config = serde_json::from_value(json).unwrap();
        let keys = c.parsed_keys().unwrap();
        (c, keys)
    }

    fn token(header: Value, claims: Value, sign: impl Fn(&[u8]) -> Vec<u8>) -> String {
        let signed = format!(
            "{}.{}",
            B64.encode(header.to_string()),
            B64.encode(claims.to_string())
        );
        format!("{signed}.{}", B64.encode(sign(signed.as_bytes())))
    }

    fn hs(secret: &str) -> impl Fn(&[u8]) -> Vec<u8> + '_ {
        move |m| {
            let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
            mac.update(m);
            mac.finalize().into_bytes().to_vec()
        }
    }

    #[test]
    fn hs256_valid_expired_and_audience() {
        let (c, k) = config(
            serde_json::json!({ "hs256_secret": "s3", "audiences": ["api"], "issuer": "me" }),
        );
        let h = serde_json::json!({ "alg": "HS256" });
        let ok = token(
            h.clone(),
            serde_json::json!({ "exp": 2000, "aud": "api", "iss": "me" }),
            hs("s3"),
        );
        assert!(verify(&c, &k, &ok, 1000).is_ok());
        assert_eq!(verify(&c, &k, &ok, 3000), Err(Refusal::Expired));
        let wrong_aud = token(
            h.clone(),
            serde_json::json!({ "exp": 2000, "aud": ["web"], "iss": "me" }),
            hs("s3"),
        );
        assert_eq!(verify(&c, &k, &wrong_aud, 1000), Err(Refusal::Audience));
        let forged = token(
            h,
            serde_json::json!({ "exp": 2000, "aud": "api", "iss": "me" }),
            hs("guess"),
        );
        assert_eq!(verify(&c, &k, &forged, 1000), Err(Refusal::Signature));
        let none = token(
            serde_json::json!({ "alg": "none" }),
            serde_json::json!({}),
            |_| Vec::new(),
        );
        assert!(matches!(
            verify(&c, &k, &none, 1000),
            Err(Refusal::Algorithm(_))
        ));
    }

    #[test]
    fn a_remembered_token_gets_the_same_edits_and_still_expires() {
        let (c, _) = config(serde_json::json!({
            "hs256_secret": "s3",
            "leeway_secs": 0,
            "claims_to_headers": { "sub": "X-User" },
        }));
        let h = serde_json::json!({ "alg": "HS256" });
        let ok = token(
            h.clone(),
            serde_json::json!({ "sub": "alice", "exp": 2000 }),
            hs("s3"),
        );
        for _ in 0..2 {
            let edits = decide(&c, ok.as_bytes(), 1000).unwrap();
            assert_eq!(edits.remove, vec!["x-user".to_owned()]);
            assert_eq!(edits.set[0].name, "x-user");
            assert_eq!(edits.set[0].value, b"alice");
        }
        assert_eq!(
            decide(&c, ok.as_bytes(), 2001).unwrap_err(),
            Refusal::Expired
        );
        let forged = token(
            h,
            serde_json::json!({ "sub": "alice", "exp": 2000 }),
            hs("guess"),
        );
        assert_eq!(
            decide(&c, forged.as_bytes(), 1000).unwrap_err(),
            Refusal::Signature
        );
        // Not remembered for being refused.
        assert_eq!(
            decide(&c, forged.as_bytes(), 1000).unwrap_err(),
            Refusal::Signature
        );
        // Bytes that are not text never reach the JSON parser.
        assert_eq!(
            decide(&c, b"\xff.\xfe.\xfd", 1000).unwrap_err(),
            Refusal::Malformed
        );
    }

    #[test]
    fn unusable_jwks_keys_are_refused_naming_the_key() {
        let refused = |key: Value| {
            let c: Config =
                serde_json::from_value(serde_json::json!({ "jwks": { "keys": [key] } })).unwrap();
            JwtAuth::validate(&c).unwrap_err()
        };
        let e = refused(serde_json::json!({ "kty": "RSA", "kid": "r1", "n": "!!", "e": "AQAB" }));
        assert!(
            e.contains("kid `r1`") && e.contains("`n` is not base64url"),
            "{e}"
        );
        let e = refused(serde_json::json!({ "kty": "RSA", "n": "AQAB" }));
        assert!(
            e.contains("JWKS key 1") && e.contains("`e` is missing"),
            "{e}"
        );
        // 32-byte coordinates, but not a point on the curve.
        let one = B64.encode([1u8; 32]);
        let e = refused(serde_json::json!({ "kty": "EC", "crv": "P-256", "x": one, "y": one }));
        assert!(e.contains("not a point on P-256"), "{e}");
        let e = refused(serde_json::json!({ "kty": "EC", "crv": "P-384", "x": one, "y": one }));
        assert!(e.contains("unsupported key"), "{e}");
    }

    #[test]
    fn rs256_and_es256_from_jwks() {
        use rsa::traits::PublicKeyParts;
        let mut rng = rand_core::OsRng;
        let rsa_key = rsa::RsaPrivateKey::new(&mut rng, 2048).unwrap();
        let ec_key = p256::ecdsa::SigningKey::random(&mut rng);
        let point = ec_key.verifying_key().to_encoded_point(false);
        let jwks = serde_json::json!({ "keys": [
            { "kty": "RSA", "kid": "r1", "n": B64.encode(rsa_key.n().to_bytes_be()), "e": B64.encode(rsa_key.e().to_bytes_be()) },
            { "kty": "EC", "kid": "e1", "crv": "P-256", "x": B64.encode(point.x().unwrap()), "y": B64.encode(point.y().unwrap()) },
        ]});
        let (c, k) = config(serde_json::json!({ "jwks": jwks }));
        let claims = serde_json::json!({ "sub": "alice", "exp": 2000 });
        let rs = token(
            serde_json::json!({ "alg": "RS256", "kid": "r1" }),
            claims.clone(),
            |m| {
                rsa_key
                    .sign(rsa::Pkcs1v15Sign::new::<Sha256>(), &Sha256::digest(m))
                    .unwrap()
            },
        );
        assert_eq!(verify(&c, &k, &rs, 1000).unwrap()["sub"], "alice");
        let es = token(
            serde_json::json!({ "alg": "ES256", "kid": "e1" }),
            claims,
            |m| {
                let sig: p256::ecdsa::Signature = ec_key.sign(m);
                sig.to_bytes().to_vec()
            },
        );
        assert!(verify(&c, &k, &es, 1000).is_ok());
        let mut tampered = es.clone();
        tampered.replace_range(tampered.len() - 5.., "AAAAA");
        assert_eq!(verify(&c, &k, &tampered, 1000), Err(Refusal::Signature));
    }
}
