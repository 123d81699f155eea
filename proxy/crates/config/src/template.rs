//! Templates filled from a route's path parameters: upstream URLs such as
//! `http://{name}-eventsource-svc.{namespace}.svc.cluster.local` and path
//! rewrites such as `/api/{rest}`.

/// One literal run or one `{param}` reference.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Param(String),
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pieces: Vec<Piece>,
    /// Parameters that land in the URL's scheme or authority; their values
    /// are restricted so a request path can never redirect the proxy to a
    /// host the policy author did not intend (`a@evil:80`, `x/y`, ...).
    authority_params: Vec<String>,
}

impl Template {
    /// Parses `{name}` references; `url` marks a URL template, whose
    /// authority part gets restricted values.
    pub fn parse(src: &str, url: bool) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut rest = src;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Literal(rest[..open].to_owned()));
            }
            let after = &rest[open + 1..];
            let close = after
                .find('}')
                .ok_or_else(|| format!("unclosed `{{` in template `{src}`"))?;
            let name = &after[..close];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!(
                    "`{{{name}}}` in `{src}` is not a parameter name (letters, digits, `_`)"
                ));
            }
            pieces.push(Piece::Param(name.to_owned()));
            rest = &after[close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("stray `}}` in template `{src}`"));
        }
        if !rest.is_empty() {
            pieces.push(Piece::Literal(rest.to_owned()));
        }
        let mut authority_params = Vec::new();
        if url {
            // The authority ends at the first `/` after `://`; everything
            // before that point is scheme or host.
            let mut seen_text = String::new();
            for piece in &pieces {
                let in_authority = match seen_text.find("://") {
                    Some(i) => !seen_text[i + 3..].contains('/'),
                    None => true,
                };
                match piece {
                    Piece::Literal(l) => seen_text.push_str(l),
                    Piece::Param(p) => {
                        if in_authority {
                            authority_params.push(p.clone());
                        }
                        seen_text.push('x');
                    }
                }
            }
        }
        Ok(Template {
            pieces,
            authority_params,
        })
    }

    /// The parameter names the template uses.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Param(name) => Some(name.as_str()),
            Piece::Literal(_) => None,
        })
    }

    /// True when the template has no parameters.
    pub fn is_static(&self) -> bool {
        self.params().next().is_none()
    }

    /// Fills the template. A parameter the match did not capture renders
    /// empty (an optional `{rest}`); an authority parameter with characters
    /// outside `[A-Za-z0-9._-]` is refused with its name.
    pub fn render<'a>(&self, param: impl Fn(&str) -> Option<&'a str>) -> Result<String, String> {
        let mut out = String::with_capacity(64);
        for piece in &self.pieces {
            match piece {
                Piece::Literal(l) => out.push_str(l),
                Piece::Param(name) => {
                    let value = param(name).unwrap_or("");
                    if self.authority_params.iter().any(|a| a == name)
                        && !value
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
                    {
                        return Err(format!(
                            "path parameter `{name}` is not a valid host name part"
                        ));
                    }
                    out.push_str(value);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::Template;

    fn params(name: &str) -> Option<&'static str> {
        match name {
            "name" => Some("github"),
            "namespace" => Some("argo"),
            "evil" => Some("a@evil.com:80"),
            "rest" => Some("a/b"),
            _ => None,
        }
    }

    #[test]
    fn url_template_renders_host_from_params() {
        let t = Template::parse(
            "http://{name}-eventsource-svc.{namespace}.svc.cluster.local",
            true,
        )
        .unwrap();
        assert_eq!(t.params().collect::<Vec<_>>(), ["name", "namespace"]);
        assert_eq!(
            t.render(params).unwrap(),
            "http://github-eventsource-svc.argo.svc.cluster.local"
        );
    }

    #[test]
    fn authority_params_refuse_host_injection() {
        let t = Template::parse("http://{evil}.svc", true).unwrap();
        assert!(t.render(params).unwrap_err().contains("`evil`"));
    }

    #[test]
    fn path_params_may_hold_slashes() {
        let t = Template::parse("http://svc/base/{rest}", true).unwrap();
        assert_eq!(t.render(params).unwrap(), "http://svc/base/a/b");
        let rewrite = Template::parse("/api/{rest}", false).unwrap();
        assert_eq!(rewrite.render(params).unwrap(), "/api/a/b");
    }

    #[test]
    fn malformed_templates_fail() {
        assert!(Template::parse("http://{name", true).is_err());
        assert!(Template::parse("http://{}/", true).is_err());
        assert!(Template::parse("http://a}/", true).is_err());
        assert!(Template::parse("/{a-b}", false).is_err());
    }
}
