//! What plugins that check bearer tokens share (`jwt-auth`,
//! `token-introspection`): the token of an `Authorization` header, the
//! audience check, and a token's claims as request headers.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::{HeaderEdits, header, no_edits};

/// The token of an `Authorization: Bearer` value. The scheme is
/// case-insensitive (RFC 9110, 11.1); the token stays bytes.
pub fn token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| token.trim_ascii())
        .filter(|t| !t.is_empty())
}

/// Whether a token's `aud` (a string or a list) holds one of `accepted`;
/// an empty `accepted` takes any.
pub fn audience_ok(aud: Option<&Value>, accepted: &[String]) -> bool {
    if accepted.is_empty() {
        return true;
    }
    match aud {
        Some(Value::String(a)) => accepted.contains(a),
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(Value::as_str)
            .any(|a| accepted.iter().any(|x| x == a)),
        _ => false,
    }
}

/// The header edits a token's claims make, by `claims_to_headers` (claim
/// → header): string, number or boolean claims set; a client-sent copy
/// of each header removed whatever the token holds.
pub fn claim_edits(
    claims_to_headers: &BTreeMap<String, String>,
    claims: &Map<String, Value>,
) -> HeaderEdits {
    let mut edits = no_edits();
    for (claim, name) in claims_to_headers {
        edits.remove.push(name.to_ascii_lowercase());
        let value = match claims.get(claim) {
            Some(Value::String(s)) => s.clone(),
            Some(v @ (Value::Number(_) | Value::Bool(_))) => v.to_string(),
            _ => continue,
        };
        edits.set.push(header(name, &value));
    }
    edits
}

/// The header edits for a request let on without a token: the claim
/// headers go, or a client could name itself in them.
pub fn anonymous_edits(claims_to_headers: &BTreeMap<String, String>) -> HeaderEdits {
    let mut edits = no_edits();
    edits.remove = claims_to_headers
        .values()
        .map(|name| name.to_ascii_lowercase())
        .collect();
    edits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_needs_a_token() {
        assert_eq!(token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(token(b"BEARER  abc \t"), Some(&b"abc"[..]));
        assert_eq!(token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(token(b"Bearer "), None);
        assert_eq!(token(b"Bearer"), None);
        assert_eq!(token(b"Basic YWxhZGRpbjpvcGVuc2VzYW1l"), None);
        assert_eq!(token(b"Bearerabc"), None);
    }

    #[test]
    fn an_audience_in_a_string_or_a_list() {
        let api = ["api".to_owned()];
        assert!(audience_ok(Some(&Value::from("api")), &api));
        assert!(audience_ok(Some(&serde_json::json!(["web", "api"])), &api));
        assert!(!audience_ok(Some(&serde_json::json!(["web"])), &api));
        assert!(!audience_ok(None, &api));
        assert!(audience_ok(None, &[]));
    }
}
