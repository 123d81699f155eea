//! An introspection answer (RFC 7662, 2.2) judged against the route's
//! config: what the request may do, and for how long that holds.

use portcullis_sdk::{HeaderEdits, bearer};
use serde_json::{Map, Value};

use crate::Config;

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// No bearer token.
    Missing,
    /// The server says it is not active (expired, revoked, unknown).
    Inactive,
    /// Active, but issued by another issuer than the config's.
    Issuer,
    /// Active, but for none of the config's audiences.
    Audience,
    /// Active, but without these scopes the config requires.
    Scope(String),
}

/// What an answer decided, and until when it holds (seconds since the
/// epoch; 0 is never kept).
#[derive(Debug)]
pub struct Judged {
    pub outcome: Result<HeaderEdits, Refusal>,
    pub until: u64,
}

/// Judges the JSON `body` of a 200 answer at `now` (seconds), or says why
/// it is no introspection answer.
pub fn judge(config: &Config, body: &[u8], now: u64) -> Result<Judged, String> {
    let fields: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| format!("the answer is not a JSON object: {e}"))?;
    let active = match fields.get("active") {
        Some(Value::Bool(b)) => *b,
        _ => return Err("the answer has no boolean `active`".into()),
    };
    if !active {
        // Anyone can make an inactive token: keeping those could only
        // flood the cache (as jwt-auth keeps no refused token).
        return Ok(Judged {
            outcome: Err(Refusal::Inactive),
            until: 0,
        });
    }
    let exp = fields.get("exp").and_then(Value::as_u64);
    // Kept no longer than the token lives (RFC 7662, 4), nor than the
    // config allows: a token revoked meanwhile is refused only when the
    // answer is asked again.
    let until = exp
        .unwrap_or(u64::MAX)
        .min(now.saturating_add(config.cache_max_secs));
    Ok(Judged {
        outcome: check(config, &fields)
            .map(|()| bearer::claim_edits(&config.claims_to_headers, &fields)),
        until,
    })
}

/// The checks the resource server makes itself (RFC 7662, 4): issuer,
/// audience, scope.
fn check(config: &Config, fields: &Map<String, Value>) -> Result<(), Refusal> {
    if let Some(iss) = &config.issuer
        && fields.get("iss").and_then(Value::as_str) != Some(iss)
    {
        return Err(Refusal::Issuer);
    }
    if !bearer::audience_ok(fields.get("aud"), &config.audiences) {
        return Err(Refusal::Audience);
    }
    // `scope` is space-separated (RFC 7662, 2.2; RFC 6749, 3.3).
    let granted: Vec<&str> = fields
        .get("scope")
        .and_then(Value::as_str)
        .map(|s| s.split(' ').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    let missing: Vec<&str> = config
        .scopes
        .iter()
        .map(String::as_str)
        .filter(|s| !granted.contains(s))
        .collect();
    if !missing.is_empty() {
        return Err(Refusal::Scope(missing.join(" ")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let json = format!(r#"{{"upstream": "idp", "path": "/introspect" {extra}}}"#);
        portcullis_sdk::parse_config(&json).unwrap()
    }

    fn set(edits: &HeaderEdits) -> Vec<(String, String)> {
        let text = |v: &[u8]| String::from_utf8(v.to_vec()).unwrap();
        edits
            .set
            .iter()
            .map(|h| (h.name.clone(), text(&h.value)))
            .collect()
    }

    #[test]
    fn an_active_answer_is_kept_until_its_exp_at_most_the_configured_time() {
        let c = config(r#", "claims_to_headers": {"sub": "x-user", "scope": "x-scope"}"#);
        let j = judge(
            &c,
            br#"{"active":true,"sub":"alice","scope":"read","exp":1100}"#,
            1000,
        )
        .unwrap();
        assert_eq!(j.until, 1100);
        let edits = j.outcome.unwrap();
        assert_eq!(
            set(&edits),
            [
                ("x-scope".into(), "read".into()),
                ("x-user".into(), "alice".into())
            ]
        );
        assert_eq!(edits.remove, ["x-scope", "x-user"], "a client's copies go");
        // A long-lived token, or one with no `exp`: `cache_max_secs`.
        let far = judge(&c, br#"{"active":true,"exp":999999}"#, 1000).unwrap();
        assert_eq!(far.until, 1300);
        assert_eq!(judge(&c, br#"{"active":true}"#, 1000).unwrap().until, 1300);
    }

    #[test]
    fn inactive_answers_are_refused_and_never_kept() {
        let j = judge(&config(""), br#"{"active":false}"#, 1000).unwrap();
        assert_eq!(j.outcome.unwrap_err(), Refusal::Inactive);
        assert_eq!(j.until, 0);
    }

    #[test]
    fn issuer_audience_and_every_scope_are_checked() {
        let c = config(
            r#", "issuer": "https://idp", "audiences": ["api"], "scopes": ["read", "write"]"#,
        );
        let judged = |body: &str| judge(&c, body.as_bytes(), 1000).unwrap().outcome;
        let base = r#""active":true,"iss":"https://idp","aud":["web","api"]"#;
        assert!(judged(&format!(r#"{{{base},"scope":"write read admin"}}"#)).is_ok());
        assert_eq!(
            judged(&format!(r#"{{{base},"scope":"read"}}"#)).unwrap_err(),
            Refusal::Scope("write".into())
        );
        assert_eq!(
            judged(r#"{"active":true,"iss":"https://other","aud":"api","scope":"read write"}"#)
                .unwrap_err(),
            Refusal::Issuer
        );
        assert_eq!(
            judged(r#"{"active":true,"iss":"https://idp","aud":"web","scope":"read write"}"#)
                .unwrap_err(),
            Refusal::Audience
        );
    }

    #[test]
    fn what_is_no_introspection_answer_says_so() {
        let c = config("");
        assert!(
            judge(&c, b"<html>", 0)
                .unwrap_err()
                .contains("not a JSON object")
        );
        assert!(
            judge(&c, br#"{"active":"yes"}"#, 0)
                .unwrap_err()
                .contains("`active`")
        );
    }
}
