//! The schema as a graph: its nodes, found from the root through
//! applicators and references, and the profile computed over them depth by
//! depth (the profile and the work model: `schema`'s module doc).
//!
//! References are resolved in the document only: `#`, `#/json/pointer`
//! (with `~0`/`~1` and percent-decoding) and `#name` (a `$anchor` or
//! `$dynamicAnchor`, unique in the document). A `$id` below the root is
//! refused: it would change what those references mean. With a single
//! resource, `$dynamicRef` and `$recursiveRef` resolve as plain references.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use serde_json::Value;

use super::patterns::pattern_weight;
use super::{DEPTHS, Profile};
use crate::error::echo;
use crate::limits::MAX_SCHEMA_EXPANSION;

/// Work of a `format` check per unit of the string it reads: `email`, the
/// dearest of the draft-07 formats, costs about 50 times a pattern scan
/// per byte in a debug build.
const FORMAT_WEIGHT: u64 = 32;

/// Profiles a schema (`schema`'s module doc): refuses references it cannot resolve in
/// the document, a `$ref` cycle that never descends, patterns the regex
/// engine would not take, and an expansion past `MAX_SCHEMA_EXPANSION`.
pub fn profile(schema: &Value) -> Result<Profile, String> {
    profile_scanned(schema, &Scan::of(schema))
}

pub(super) fn profile_scanned(schema: &Value, scan: &Scan<'_>) -> Result<Profile, String> {
    let graph = Graph::build(schema, scan)?;
    if graph.nodes.iter().any(|n| n.unevaluated) && graph.has_cycle() {
        // jsonschema 0.61 leaks the validators of `unevaluated*` reached
        // through a reference back into themselves (an `Arc` cycle, ~88 KB
        // per compile; found by fuzzing under LeakSanitizer): every new
        // schema text would leak again.
        return Err(
            "uses unevaluatedProperties or unevaluatedItems in a recursive schema (a $ref back into itself), which this broker does not support"
                .to_owned(),
        );
    }
    let (graph, order) = graph.children_first()?;
    graph.layers(&order)
}

/// What a whole-document pass finds: anchors (`None` when a name is
/// ambiguous) and the distinct patterns (`pattern` values and
/// `patternProperties` keys, wherever they are: a superset of what
/// compiles).
pub(super) struct Scan<'a> {
    anchors: HashMap<&'a str, Option<&'a Value>>,
    pub(super) patterns: HashSet<&'a str>,
}

impl<'a> Scan<'a> {
    pub(super) fn of(root: &'a Value) -> Self {
        let mut scan = Scan {
            anchors: HashMap::new(),
            patterns: HashSet::new(),
        };
        let mut stack = vec![root];
        while let Some(value) = stack.pop() {
            match value {
                Value::Object(map) => {
                    for keyword in ["$anchor", "$dynamicAnchor"] {
                        if let Some(Value::String(name)) = map.get(keyword) {
                            scan.anchors
                                .entry(name.as_str())
                                .and_modify(|seen| {
                                    if !seen.is_some_and(|s| std::ptr::eq(s, value)) {
                                        *seen = None;
                                    }
                                })
                                .or_insert(Some(value));
                        }
                    }
                    if let Some(Value::String(pattern)) = map.get("pattern") {
                        scan.patterns.insert(pattern);
                    }
                    if let Some(Value::Object(patterns)) = map.get("patternProperties") {
                        scan.patterns.extend(patterns.keys().map(String::as_str));
                    }
                    stack.extend(map.values());
                }
                Value::Array(items) => stack.extend(items),
                _ => {}
            }
        }
        scan
    }
}

/// Where an applicator's subschema applies, relative to the output node
/// its parent applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// The same node; these add up.
    Here,
    /// The same node, one of several (`then`/`else`).
    HereEither,
    /// Each member of an object (or its key).
    Member,
    /// The members of one name only (`properties`).
    OneMember,
    /// Each element of an array.
    Element,
    /// The element at one index only (`prefixItems`, tuple `items`).
    OneElement,
}

impl Slot {
    fn in_place(self) -> bool {
        matches!(self, Self::Here | Self::HereEither)
    }
}

#[derive(Clone, Copy, Debug)]
struct Edge {
    to: usize,
    slot: Slot,
    /// A `contains` subschema (re-checked by `unevaluatedItems`).
    contains: bool,
    /// An `anyOf` or `oneOf` branch (see `Tally::rechecked`).
    rechecked: bool,
}

/// What the profile adds up per depth (`schema`'s module doc), saturating.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally {
    paths: u64,
    weight: u64,
    unique: u64,
    error_weight: u64,
    error_unique: u64,
}

impl Tally {
    fn zip(self, other: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        Self {
            paths: f(self.paths, other.paths),
            weight: f(self.weight, other.weight),
            unique: f(self.unique, other.unique),
            error_weight: f(self.error_weight, other.error_weight),
            error_unique: f(self.error_unique, other.error_unique),
        }
    }

    fn add(self, other: Self) -> Self {
        self.zip(other, u64::saturating_add)
    }

    fn max(self, other: Self) -> Self {
        self.zip(other, u64::max)
    }

    fn times(self, factor: u64) -> Self {
        self.zip(self, |a, _| a.saturating_mul(factor))
    }

    /// Collecting errors re-checks an `anyOf`/`oneOf` branch once before
    /// descending into it.
    fn rechecked(self) -> Self {
        Self {
            error_weight: self.error_weight.saturating_add(self.weight),
            error_unique: self.error_unique.saturating_add(self.unique),
            ..self
        }
    }
}

/// One schema node: what it costs where it applies, and its applicators.
struct Node {
    own: Tally,
    edges: Vec<Edge>,
    /// Has `unevaluatedProperties` or `unevaluatedItems`.
    unevaluated: bool,
    /// Longest chain of in-place edges from here.
    nesting: u64,
}

impl Node {
    /// This node's tally at output depth `d`, where it applies to an object
    /// and to an array, from its in-place children's at `d` (`here`) and
    /// its descending children's at `d - 1` (`above`).
    fn tally(&self, d: usize, here: &[(Tally, Tally)], above: &[Tally]) -> (Tally, Tally) {
        let (mut object, mut array) = (Tally::default(), Tally::default());
        let (mut either, mut one_member, mut one_element) = (
            (Tally::default(), Tally::default()),
            Tally::default(),
            Tally::default(),
        );
        for edge in &self.edges {
            let f = self.factor(edge);
            let (mut o, mut a) = here[edge.to];
            if edge.rechecked {
                (o, a) = (o.rechecked(), a.rechecked());
            }
            let below = above[edge.to].times(f);
            match edge.slot {
                Slot::Here => {
                    object = object.add(o.times(f));
                    array = array.add(a.times(f));
                }
                Slot::HereEither => {
                    either = (either.0.max(o.times(f)), either.1.max(a.times(f)));
                }
                Slot::Member if d > 0 => object = object.add(below),
                Slot::OneMember if d > 0 => one_member = one_member.max(below),
                Slot::Element if d > 0 => array = array.add(below),
                Slot::OneElement if d > 0 => one_element = one_element.max(below),
                _ => {}
            }
        }
        object = object.add(either.0).add(one_member);
        array = array.add(either.1).add(one_element);
        if d == 0 {
            object = object.add(self.own);
            array = array.add(self.own);
        }
        (object, array)
    }

    /// How many times a child is evaluated each time this node is.
    fn factor(&self, edge: &Edge) -> u64 {
        if !self.unevaluated {
            1
        } else if edge.slot.in_place() {
            self.nesting.saturating_add(2)
        } else if edge.contains {
            2
        } else {
            1
        }
    }
}

/// The schema's nodes, found from the root through applicators and
/// references; node 0 is the root.
struct Graph {
    nodes: Vec<Node>,
}

/// Discovery state of `Graph::build`.
struct Walk<'s, 'a> {
    root: &'a Value,
    scan: &'s Scan<'a>,
    /// Draft 4 names a schema's base URI `id` rather than `$id`.
    legacy_id: bool,
    index: HashMap<*const Value, usize>,
    values: Vec<&'a Value>,
    pattern_weights: HashMap<&'a str, u64>,
}

impl Graph {
    fn build(root: &Value, scan: &Scan<'_>) -> Result<Self, String> {
        let legacy_id = root
            .get("$schema")
            .and_then(Value::as_str)
            .is_some_and(|s| s.contains("draft-04"));
        let mut walk = Walk {
            root,
            scan,
            legacy_id,
            index: HashMap::new(),
            values: Vec::new(),
            pattern_weights: HashMap::new(),
        };
        walk.id(root);
        let mut nodes = Vec::new();
        // `values` grows as nodes are discovered; each is expanded once.
        while nodes.len() < walk.values.len() {
            let node = walk.expand(nodes.len())?;
            nodes.push(node);
        }
        Ok(Self { nodes })
    }

    /// Whether any edge, in-place or descending, lies on a cycle: the
    /// schema refers back into itself somewhere.
    fn has_cycle(&self) -> bool {
        let n = self.nodes.len();
        let mut parents = vec![0usize; n];
        for node in &self.nodes {
            for edge in &node.edges {
                parents[edge.to] += 1;
            }
        }
        let mut ready: Vec<usize> = (0..n).filter(|&i| parents[i] == 0).collect();
        let mut seen = 0;
        while let Some(i) = ready.pop() {
            seen += 1;
            for edge in &self.nodes[i].edges {
                parents[edge.to] -= 1;
                if parents[edge.to] == 0 {
                    ready.push(edge.to);
                }
            }
        }
        seen < n
    }

    /// The nodes ordered so that every in-place child comes before its
    /// parent (Kahn's algorithm), with each node's `nesting` set; an error
    /// if in-place edges form a cycle.
    fn children_first(mut self) -> Result<(Self, Vec<usize>), String> {
        let n = self.nodes.len();
        let mut parents = vec![0usize; n];
        for node in &self.nodes {
            for edge in node.edges.iter().filter(|e| e.slot.in_place()) {
                parents[edge.to] += 1;
            }
        }
        let mut ready: Vec<usize> = (0..n).filter(|&i| parents[i] == 0).collect();
        let mut parents_first = Vec::with_capacity(n);
        while let Some(i) = ready.pop() {
            parents_first.push(i);
            for edge in self.nodes[i].edges.iter().filter(|e| e.slot.in_place()) {
                parents[edge.to] -= 1;
                if parents[edge.to] == 0 {
                    ready.push(edge.to);
                }
            }
        }
        if parents_first.len() < n {
            return Err(
                "has a reference cycle that never descends into the output (like {\"$ref\": \"#\"}): validation would not end"
                    .to_owned(),
            );
        }
        let order: Vec<usize> = parents_first.into_iter().rev().collect();
        for &i in &order {
            let nesting = self.nodes[i]
                .edges
                .iter()
                .filter(|e| e.slot.in_place())
                .map(|e| self.nodes[e.to].nesting.saturating_add(1))
                .max()
                .unwrap_or(0);
            self.nodes[i].nesting = nesting;
        }
        Ok((self, order))
    }

    /// The profile: the root's tally at each depth, computed depth by depth
    /// over the nodes in `order` (children first; `schema`'s module doc).
    fn layers(&self, order: &[usize]) -> Result<Profile, String> {
        let n = self.nodes.len();
        let mut profile = Profile {
            paths: vec![0; DEPTHS],
            weight: vec![0; DEPTHS],
            unique: vec![0; DEPTHS],
            error_weight: vec![0; DEPTHS],
            error_unique: vec![0; DEPTHS],
        };
        // Below the output's root, only nodes that descend (or apply one
        // that does in place) can apply anything: the others are left out.
        let mut descends = vec![false; n];
        for &i in order {
            descends[i] = self.nodes[i]
                .edges
                .iter()
                .any(|e| !e.slot.in_place() || descends[e.to]);
        }
        let deeper: Vec<usize> = order.iter().copied().filter(|&i| descends[i]).collect();
        // Each node's tally at the depth above: what applies below its
        // members and elements.
        let mut above = vec![Tally::default(); n];
        // At this depth, where the node applies to an object (`.0`) or an
        // array (`.1`).
        let mut here = vec![(Tally::default(), Tally::default()); n];
        let mut expansion = 0u64;
        for d in 0..DEPTHS {
            let layer = if d == 0 { order } else { &deeper };
            if d == 1 {
                here.fill(Default::default());
            }
            for &i in layer {
                here[i] = self.nodes[i].tally(d, &here, &above);
            }
            if d == 1 {
                above.fill(Tally::default());
            }
            for &i in layer {
                above[i] = here[i].0.max(here[i].1);
            }
            let root = above[0];
            // No path of the schema descends this far: none descends further.
            if root.paths == 0 {
                break;
            }
            profile.paths[d] = root.paths;
            profile.weight[d] = root.weight;
            profile.unique[d] = root.unique;
            profile.error_weight[d] = root.error_weight;
            profile.error_unique[d] = root.error_unique;
            expansion = expansion.saturating_add(root.paths);
            if expansion > MAX_SCHEMA_EXPANSION {
                return Err(format!(
                    "applies more than MAX_SCHEMA_EXPANSION ({MAX_SCHEMA_EXPANSION}) schema nodes along one path of the output ({expansion} by depth {d}): anyOf, oneOf, allOf, not, if and $ref branches multiply"
                ));
            }
        }
        Ok(profile)
    }
}

impl<'a> Walk<'_, 'a> {
    /// The node id of a schema value, by address.
    fn id(&mut self, value: &'a Value) -> usize {
        let next = self.values.len();
        let id = *self.index.entry(std::ptr::from_ref(value)).or_insert(next);
        if id == next {
            self.values.push(value);
        }
        id
    }

    /// Whether a value sets a base URI for the references inside it.
    fn sets_base(&self, value: &Value) -> bool {
        let named = |keyword| value.get(keyword).is_some_and(Value::is_string);
        named("$id") || (self.legacy_id && named("id"))
    }

    fn expand(&mut self, i: usize) -> Result<Node, String> {
        let value = self.values[i];
        let mut node = Node {
            own: Tally {
                paths: 1,
                weight: 1,
                unique: 0,
                error_weight: 1,
                error_unique: 0,
            },
            edges: Vec::new(),
            unevaluated: false,
            nesting: 0,
        };
        // A boolean schema, or a value `jsonschema` refuses to compile.
        let Value::Object(map) = value else {
            return Ok(node);
        };
        if i != 0 && self.sets_base(value) {
            return Err(
                "sets $id below the root; references are resolved in the root document only"
                    .to_owned(),
            );
        }
        let mut weight = 1 + len(map.len());
        for (keyword, sub) in map {
            let (edges, scanned) = self.applicators(keyword, sub)?;
            for (target, slot) in edges {
                let to = self.id(target);
                node.edges.push(Edge {
                    to,
                    slot,
                    contains: keyword == "contains",
                    rechecked: keyword == "anyOf" || keyword == "oneOf",
                });
            }
            weight = weight.saturating_add(scanned);
        }
        node.unevaluated =
            map.contains_key("unevaluatedProperties") || map.contains_key("unevaluatedItems");
        let unique = u64::from(map.get("uniqueItems") == Some(&Value::Bool(true)));
        node.own = Tally {
            paths: 1,
            weight,
            unique,
            error_weight: weight,
            error_unique: unique,
        };
        Ok(node)
    }

    /// One keyword's subschemas and where they apply, and what it scans per
    /// output node (its share of the weight).
    #[allow(clippy::type_complexity)]
    fn applicators(
        &mut self,
        keyword: &str,
        sub: &'a Value,
    ) -> Result<(Vec<(&'a Value, Slot)>, u64), String> {
        let each = |slot: Slot| -> Vec<(&'a Value, Slot)> {
            match sub {
                Value::Array(items) => schemas(items.iter(), slot),
                _ => Vec::new(),
            }
        };
        let one = |slot: Slot| schemas(std::iter::once(sub), slot);
        let values = |slot: Slot| -> Vec<(&'a Value, Slot)> {
            match sub {
                Value::Object(map) => schemas(map.values(), slot),
                _ => Vec::new(),
            }
        };
        let entries = || match sub {
            Value::Object(map) => len(map.len()),
            _ => 0,
        };
        Ok(match keyword {
            "allOf" | "anyOf" | "oneOf" => (each(Slot::Here), 0),
            "not" | "if" => (one(Slot::Here), 0),
            "then" | "else" => (one(Slot::HereEither), 0),
            "$ref" | "$dynamicRef" | "$recursiveRef" => match sub.as_str() {
                Some(reference) => (vec![(self.resolve(reference)?, Slot::Here)], 0),
                None => (Vec::new(), 0),
            },
            "dependentSchemas" => (values(Slot::Here), entries()),
            "dependencies" => {
                // Draft 7: each value is a schema or a list of names.
                let scanned = match sub {
                    Value::Object(map) => map
                        .values()
                        .filter(|v| v.is_array())
                        .fold(entries(), |a, v| a.saturating_add(json_size(v))),
                    _ => 0,
                };
                (values(Slot::Here), scanned)
            }
            "properties" => (values(Slot::OneMember), entries()),
            "patternProperties" => {
                let mut scanned = entries();
                if let Value::Object(map) = sub {
                    for pattern in map.keys() {
                        scanned = scanned.saturating_add(self.pattern_weight(pattern)?);
                    }
                }
                (values(Slot::Member), scanned)
            }
            "additionalProperties" | "propertyNames" | "unevaluatedProperties" => {
                (one(Slot::Member), 0)
            }
            "items" if sub.is_array() => (each(Slot::OneElement), 0),
            "items" | "additionalItems" | "contains" | "unevaluatedItems" => {
                (one(Slot::Element), 0)
            }
            "prefixItems" => (each(Slot::OneElement), 0),
            "pattern" => match sub.as_str() {
                Some(pattern) => (Vec::new(), self.pattern_weight(pattern)?),
                None => (Vec::new(), 0),
            },
            "enum" | "const" | "required" | "dependentRequired" => (Vec::new(), json_size(sub)),
            // Format checks parse the string (an address, a date, a URI):
            // dearer per byte than a scan (measured against the other
            // keywords by `the_work_estimate_follows_validation_time_across_keywords`).
            "format" => (Vec::new(), FORMAT_WEIGHT),
            "type" => (
                Vec::new(),
                sub.as_array().map_or(0, |types| len(types.len())),
            ),
            _ => (Vec::new(), 0),
        })
    }

    /// Resolves a reference in the document (module doc).
    fn resolve(&self, reference: &str) -> Result<&'a Value, String> {
        let refused = |why: &str| format!("$ref {}: {why}", echo(reference));
        let Some(fragment) = reference.strip_prefix('#') else {
            return Err(refused(
                "only references inside the schema (\"#...\") are supported",
            ));
        };
        let fragment = percent_decode(fragment).ok_or_else(|| refused("bad percent-encoding"))?;
        let target = if fragment.is_empty() {
            Some(self.root)
        } else if let Some(pointer) = fragment.strip_prefix('/') {
            let mut at = self.root;
            for token in pointer.split('/') {
                let token = unescape(token).ok_or_else(|| refused("bad JSON pointer escape"))?;
                let next = match at {
                    Value::Object(map) => map.get(token.as_ref()),
                    Value::Array(items) => array_index(&token).and_then(|i| items.get(i)),
                    _ => None,
                };
                let Some(next) = next else {
                    return Err(refused("points to nothing in this schema"));
                };
                if self.sets_base(next) {
                    return Err(refused(
                        "passes a $id below the root; references are resolved in the root document only",
                    ));
                }
                at = next;
            }
            Some(at)
        } else {
            match self.scan.anchors.get(fragment.as_str()) {
                Some(Some(anchored)) => Some(*anchored),
                Some(None) => return Err(refused("names an anchor defined more than once")),
                None => None,
            }
        };
        match target {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(schema),
            _ => Err(refused("does not resolve to a schema in this document")),
        }
    }

    fn pattern_weight(&mut self, pattern: &'a str) -> Result<u64, String> {
        if let Some(weight) = self.pattern_weights.get(pattern) {
            return Ok(*weight);
        }
        let weight = pattern_weight(pattern)?;
        self.pattern_weights.insert(pattern, weight);
        Ok(weight)
    }
}

/// The values among `items` that are schemas, each with `slot`.
fn schemas<'a>(items: impl Iterator<Item = &'a Value>, slot: Slot) -> Vec<(&'a Value, Slot)> {
    items
        .filter(|v| v.is_object() || v.is_boolean())
        .map(|v| (v, slot))
        .collect()
}

pub(super) fn len(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Nodes plus string and key bytes of a JSON value, without recursion.
fn json_size(value: &Value) -> u64 {
    let mut size = 0u64;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        let own = match v {
            Value::String(s) => s.len(),
            Value::Array(items) => {
                stack.extend(items);
                0
            }
            Value::Object(map) => {
                stack.extend(map.values());
                map.keys().map(String::len).sum()
            }
            _ => 0,
        };
        size = size.saturating_add(1 + len(own));
    }
    size
}

/// A URI fragment's percent-escapes decoded; `None` if malformed or not
/// UTF-8.
fn percent_decode(fragment: &str) -> Option<String> {
    if !fragment.contains('%') {
        return Some(fragment.to_owned());
    }
    let bytes = fragment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A JSON pointer token with `~1` and `~0` undone; `None` on another `~`.
fn unescape(token: &str) -> Option<Cow<'_, str>> {
    if !token.contains('~') {
        return Some(Cow::Borrowed(token));
    }
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return None,
            }
        } else {
            out.push(c);
        }
    }
    Some(Cow::Owned(out))
}

/// A JSON pointer array index: digits, no leading zero.
fn array_index(token: &str) -> Option<usize> {
    let digits = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
    (digits && (token == "0" || !token.starts_with('0')))
        .then(|| token.parse().ok())
        .flatten()
}
