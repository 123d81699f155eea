//! A failed policy file's outline: every node of its YAML with where it
//! starts and ends and the key it is the value of, so an error's location
//! (which serde gives as a line and column) names the field at fault and
//! quotes its value, in block and flow style alike, and so exactly that
//! entry can be blanked for the next parse.

use granit_parser::{Event, Parser, StructureStyle};

/// A place in the text: line (1-based) and column (0-based, characters),
/// with its byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct At {
    pub line: usize,
    pub col: usize,
    pub byte: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Map,
    List,
    Value,
}

#[derive(Debug)]
pub(super) struct Node {
    pub kind: Kind,
    pub flow: bool,
    pub start: At,
    /// Where it ends (exclusive): for a block collection, where the next
    /// token starts.
    pub end: At,
    /// The key it is the value of, and where that key starts; `None` for
    /// a list item or the document itself.
    pub key: Option<(String, At)>,
    /// Where that key ends (a byte offset).
    pub key_end: usize,
    pub parent: Option<usize>,
    /// A value's text.
    pub value: Option<String>,
    /// A map's keys.
    pub keys: Vec<String>,
}

/// The nodes of a document in the order they start.
pub(super) struct Outline {
    nodes: Vec<Node>,
}

/// What a collection being read waits for next.
struct Open {
    node: usize,
    /// For a map: the key read, whose value comes next.
    key: Option<(String, At, usize)>,
}

impl Outline {
    /// The outline of `text`, or `None` when it is not well-formed YAML.
    pub(super) fn of(text: &str) -> Option<Outline> {
        let mut nodes: Vec<Node> = Vec::new();
        let mut open: Vec<Open> = Vec::new();
        for event in Parser::new_from_str(text) {
            let (event, span) = event.ok()?;
            let at = |m: granit_parser::Marker| At {
                line: m.line(),
                col: m.col(),
                byte: m.byte_offset().unwrap_or(0),
            };
            let (start, end) = (at(span.start), at(span.end));
            let (kind, flow, value) = match event {
                Event::Scalar(v, ..) => (Kind::Value, false, Some(v.into_owned())),
                Event::Alias(_) => (Kind::Value, false, Some("*alias".to_owned())),
                Event::MappingStart(style, ..) => (Kind::Map, style == StructureStyle::Flow, None),
                Event::SequenceStart(style, ..) => {
                    (Kind::List, style == StructureStyle::Flow, None)
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    let closed = open.pop()?;
                    // A flow collection ends after its bracket; a block
                    // one where the next token starts.
                    nodes[closed.node].end = if nodes[closed.node].flow { end } else { start };
                    continue;
                }
                _ => continue,
            };
            let parent = open.last().map(|o| o.node);
            // In a map, a value is a key until one is read, then that
            // key's value.
            let mut key = None;
            let mut key_end = 0;
            if let Some(o) = open.last_mut()
                && nodes[o.node].kind == Kind::Map
            {
                match o.key.take() {
                    Some((name, at, end)) => {
                        key = Some((name, at));
                        key_end = end;
                    }
                    None => {
                        let name = value.clone().unwrap_or_default();
                        nodes[o.node].keys.push(name.clone());
                        o.key = Some((name, start, end.byte));
                        // A key that is a collection (rare, never ours)
                        // is outlined as a node of its own.
                        if kind == Kind::Value {
                            continue;
                        }
                    }
                }
            }
            let index = nodes.len();
            nodes.push(Node {
                kind,
                flow,
                start,
                end,
                key,
                key_end,
                parent,
                value,
                keys: Vec::new(),
            });
            if kind != Kind::Value {
                open.push(Open {
                    node: index,
                    key: None,
                });
            }
        }
        Some(Outline { nodes })
    }

    pub(super) fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    /// The `name:` values of maps within node `i` (itself included).
    pub(super) fn names_within(&self, i: usize) -> impl Iterator<Item = &str> {
        let within = move |mut n: usize| loop {
            if n == i {
                return true;
            }
            match self.nodes[n].parent {
                Some(p) => n = p,
                None => return false,
            }
        };
        self.nodes.iter().filter_map(move |node| {
            let named = node.key.as_ref().is_some_and(|(k, _)| k == "name");
            let parent = node.parent?;
            (named && node.kind == Kind::Value && within(parent)).then_some(node.value.as_deref()?)
        })
    }

    /// The outermost node that starts at `line`:`col`, when one does.
    pub(super) fn value_at(&self, line: usize, col: usize) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.start.line == line && n.start.col == col)
    }

    /// The node whose key starts at `line`:`col`, when one does.
    pub(super) fn entry_at(&self, line: usize, col: usize) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.key
                .as_ref()
                .is_some_and(|(_, k)| k.line == line && k.col == col)
        })
    }

    /// The map that lacks `field` and was read last before `line`:`col`
    /// (where serde notices a field missing: as the map ends).
    pub(super) fn lacking(&self, field: &str, line: usize, col: usize) -> Option<usize> {
        let place = (line, col);
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| {
                n.kind == Kind::Map
                    && !n.keys.iter().any(|k| k == field)
                    && (n.start.line, n.start.col) <= place
            })
            // Ended last; of those ending together, the innermost.
            .max_by_key(|(_, n)| ((n.end.line, n.end.col).min(place), n.start))
            .map(|(i, _)| i)
    }

    /// The bytes an entry takes: from its key (or, for a list item, its
    /// dash) to the end of its value, with the comma that separates it
    /// from the next in a flow collection.
    pub(super) fn entry_bytes(&self, i: usize, text: &str) -> std::ops::Range<usize> {
        let n = &self.nodes[i];
        let mut from = match &n.key {
            Some((_, k)) => k.byte,
            None => n.start.byte,
        };
        let in_flow = n.parent.is_some_and(|p| self.nodes[p].flow);
        if n.key.is_none() && !in_flow {
            // A block list item: back to its dash.
            let before = &text[..from];
            let trimmed = before.trim_end_matches(' ');
            if trimmed.ends_with('-') {
                from = trimmed.len() - 1;
            }
        }
        let mut to = n.end.byte.max(from);
        if n.key.is_some() && to <= n.key_end {
            // No value (a null): the entry ends after its colon.
            to = n.key_end;
            let rest = &text[to..];
            let gap = rest.len() - rest.trim_start_matches([' ', '\t']).len();
            if rest[gap..].starts_with(':') {
                to += gap + 1;
            }
        }
        if in_flow {
            let rest = &text[to..];
            let gap = rest.len() - rest.trim_start().len();
            if rest[gap..].starts_with(',') {
                to += gap + 1;
            }
        }
        from..to
    }
}
