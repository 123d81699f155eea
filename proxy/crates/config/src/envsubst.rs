//! `${NAME}` and `${NAME:-default}` references in policy values.
//!
//! The default may itself contain braces (URL templates such as
//! `${EVENTSOURCE_URL:-http://{name}.svc}`) and nested references, so the
//! closing brace is found by counting depth. `$$` is a literal `$`.

/// How deep references may nest in defaults: each level is a call deeper
/// (and a scan of what is left), so a value with thousands of `${A:-`
/// would otherwise overflow the stack of a reload.
const MAX_DEPTH: usize = 16;

/// `message` with every value of `substituted` (value, where it came
/// from) replaced by where it came from: an error about a value from
/// `${WEBHOOK_SECRET}` names the variable, never the secret.
pub fn redact(mut message: String, substituted: &[(String, String)]) -> String {
    for (value, reference) in substituted {
        if message.contains(value.as_str()) {
            message = message.replace(value.as_str(), &format!("<{reference}>"));
        }
    }
    message
}

/// Expands every reference in `input`, looking names up with `lookup`.
pub fn expand(input: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    expand_at(input, lookup, 0)
}

fn expand_at(
    input: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
    depth: usize,
) -> Result<String, String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "`${{` references nested more than {MAX_DEPTH} deep in `{}`",
            input.chars().take(80).collect::<String>()
        ));
    }
    if !input.contains('$') {
        return Ok(input.to_owned());
    }
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body_and_tail) = after.strip_prefix('{') {
            let end = closing_brace(body_and_tail)
                .ok_or_else(|| format!("unterminated `${{` in `{input}`"))?;
            out.push_str(&reference(&body_and_tail[..end], lookup, depth)?);
            rest = &body_and_tail[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Index of the `}` that closes a reference whose body starts at `s`.
fn closing_brace(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return Some(i),
            '}' => depth -= 1,
            _ => {}
        }
    }
    None
}

fn reference(
    body: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
    depth: usize,
) -> Result<String, String> {
    // `${NAME:+word}`: word when NAME is set and not empty, else nothing —
    // for switches such as `enabled: "${WEBHOOK_SECRET:+true}"`.
    let plus = body.find(":+");
    if let Some(i) = plus.filter(|&p| body.find(":-").is_none_or(|m| p < m)) {
        let name = &body[..i];
        check_name(name, body)?;
        return match lookup(name) {
            Some(v) if !v.is_empty() => expand_at(&body[i + 2..], lookup, depth + 1),
            _ => Ok(String::new()),
        };
    }
    let (name, default) = match body.find(":-") {
        Some(i) => (&body[..i], Some(&body[i + 2..])),
        None => (body, None),
    };
    check_name(name, body)?;
    match (lookup(name), default) {
        // Like the shell's `:-`, an empty variable also takes the default.
        (Some(v), Some(d)) if v.is_empty() => expand_at(d, lookup, depth + 1),
        (Some(v), _) => Ok(v),
        (None, Some(d)) => expand_at(d, lookup, depth + 1),
        (None, None) => Err(format!(
            "environment variable `{name}` is not set; set it or give a default as ${{{name}:-value}}"
        )),
    }
}

fn check_name(name: &str, body: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    if valid {
        Ok(())
    } else {
        Err(format!(
            "`${{{body}}}` is not a valid environment reference: use ${{NAME}}, ${{NAME:-default}} or ${{NAME:+value}}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::expand;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("example.com".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    #[test]
    fn plain_text_is_unchanged() {
        assert_eq!(expand("http://a:80/x", &env).unwrap(), "http://a:80/x");
    }

    #[test]
    fn set_variable_wins_over_default() {
        assert_eq!(
            expand("http://${HOST:-other}/", &env).unwrap(),
            "http://example.com/"
        );
    }

    #[test]
    fn default_may_hold_template_braces() {
        assert_eq!(
            expand("${URL:-http://{name}-svc.{ns}.svc}", &env).unwrap(),
            "http://{name}-svc.{ns}.svc"
        );
    }

    #[test]
    fn nested_default_and_empty_variable() {
        assert_eq!(expand("${EMPTY:-${HOST}}", &env).unwrap(), "example.com");
    }

    #[test]
    fn plus_form_gives_the_word_only_when_set() {
        assert_eq!(expand("${HOST:+true}", &env).unwrap(), "true");
        assert_eq!(expand("${EMPTY:+true}", &env).unwrap(), "");
        assert_eq!(expand("${NOPE:+true}", &env).unwrap(), "");
    }

    #[test]
    fn dollar_escape_and_lone_dollar() {
        assert_eq!(expand("a$$b $c", &env).unwrap(), "a$b $c");
    }

    #[test]
    fn missing_variable_names_it() {
        let err = expand("${NOPE}", &env).unwrap_err();
        assert!(err.contains("`NOPE` is not set"), "{err}");
    }

    #[test]
    fn unterminated_and_invalid_names_fail() {
        assert!(expand("${HOST", &env).is_err());
        assert!(expand("${1BAD}", &env).is_err());
        assert!(expand("${}", &env).is_err());
    }

    #[test]
    fn references_nested_deeper_than_the_limit_are_an_error_not_a_crash() {
        let deep = |n: usize| format!("{}x{}", "${A:-".repeat(n), "}".repeat(n));
        assert_eq!(
            expand(&deep(super::MAX_DEPTH), &|_| None).as_deref(),
            Ok("x")
        );
        let e = expand(&deep(100_000), &|_| None).expect_err("nested 100,000 deep");
        assert!(e.contains("nested more than 16 deep"), "{e}");
    }
}
