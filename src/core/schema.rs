//! The JSON Schema a contract names for its completion output: what makes
//! one acceptable at issuance, and what validating an output against it may
//! cost at judgment. Owns the schema's pattern bounds (regex size limits, at
//! most `MAX_SCHEMA_PATTERNS`), its `Profile` (found at issuance, refused
//! past `MAX_SCHEMA_EXPANSION`), the work estimate that gates validation
//! (`MAX_SCHEMA_WORK`), and the process-wide memo of compiled schemas.
//!
//! Why. `jsonschema` validates by walking the schema over the output:
//! `allOf`, `anyOf`, `oneOf`, `not`, `if` and `$ref` apply several schemas
//! to the same output node, so a chain of them multiplies (a 3.9 KB chain of
//! two-way `anyOf`s doubles per level), and a short `pattern` can compile to
//! megabytes of automaton (`[\p{L}\p{N}]{50}N`).
//!
//! The profile. Schema nodes (objects and booleans, told apart by address)
//! are linked by *in-place* applicators, which apply to the same output
//! node (`allOf`/`anyOf`/`oneOf` items, `not`, `if`/`then`/`else`, `$ref`,
//! `$dynamicRef` and `$recursiveRef` resolved in the document,
//! `dependentSchemas`, schema-valued `dependencies`), and *descending* ones,
//! which apply to a member (`properties`, `patternProperties`,
//! `additionalProperties`, `propertyNames`, `unevaluatedProperties`) or an
//! element (`items`, `prefixItems`, `additionalItems`, `contains`,
//! `unevaluatedItems`). `paths[d]` bounds how many schema nodes apply to any
//! one output node at depth d: in-place children add up (only one of `then`
//! and `else`); a member gets at most one `properties` entry and an element
//! one `prefixItems` (or tuple `items`) entry, plus everything else that
//! descends; an output node is an object or an array, never both, so the
//! larger side counts. It is computed depth by depth over the schema
//! nodes, children first, in O(nodes × depths) whatever the sharing,
//! iteratively (no recursion). A `$ref` cycle that never descends is
//! refused, and so is a schema whose `Σ paths[d]` exceeds
//! `MAX_SCHEMA_EXPANSION`. `unevaluatedProperties`/`unevaluatedItems`
//! re-validate their node's in-place subschemas to learn what those
//! evaluated, once more per level of in-place nesting: their node's
//! in-place edges count 2 + that nesting depth times (its `contains`
//! twice).
//!
//! The work model, an upper bound up to a constant factor. Each schema
//! node applies at most `paths[d]` times to an output node at depth d, and
//! each application does work linear in the node's *weight* times the
//! output node's *cost*. A node's weight is 1 + its keywords + what it
//! scans per output node: the entries of `properties`, `patternProperties`
//! and `dependent*`, the JSON size of `enum`, `const` and `required`, and
//! for each pattern the automaton positions it can keep alive
//! (bounded repetitions counted out), since the regex engine, once its
//! small lazy DFA gives up, steps every live position at every byte
//! (`[ab]*a[ab]{904}c`, within the size limit, costs ~40 µs per byte in a
//! debug build). An output node costs 1 + its string's bytes + its members
//! or elements + its keys' bytes (and a member its key's bytes again, for
//! `propertyNames`). `Profile::work` is Σ_d weight[d] × cost(d), plus, for
//! `uniqueItems`, `UNIQUE_ITEMS_FACTOR` × the subtrees it compares.
//! Collecting error details re-checks every `anyOf`/`oneOf` branch before
//! descending into it, so `Profile::error_work` counts each node once more
//! per such applicator above it.
//!
//! References are resolved in the document only: `#`, `#/json/pointer`
//! (with `~0`/`~1` and percent-decoding) and `#name` (a `$anchor` or
//! `$dynamicAnchor`, unique in the document). A `$id` below the root is
//! refused: it would change what those references mean. With a single
//! resource, `$dynamicRef` and `$recursiveRef` resolve as plain references.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use regex_syntax::hir::{Hir, HirKind};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::error::echo;
use super::limits::{
    MAX_COMPILED_SCHEMA_BYTES, MAX_COMPILED_SCHEMAS, MAX_REGEX_FORMAT_BYTES, MAX_REGEX_FORMAT_NEST,
    MAX_RESULT_DEPTH, MAX_SCHEMA_EXPANSION, MAX_SCHEMA_PATTERNS, REGEX_DFA_SIZE_LIMIT_BYTES,
    REGEX_SIZE_LIMIT_BYTES,
};

/// Output depths a profile covers: the root (0) to `MAX_RESULT_DEPTH`.
const DEPTHS: usize = MAX_RESULT_DEPTH + 1;

/// Work of a `format` check per unit of the string it reads: `email`, the
/// dearest of the draft-07 formats, costs about 50 times a pattern scan
/// per byte in a debug build.
const FORMAT_WEIGHT: u64 = 32;

/// Work of `uniqueItems` per unit of the arrays it checks: up to 15 items
/// are compared pairwise (each with 14 others), more are hashed.
const UNIQUE_ITEMS_FACTOR: u64 = 16;

/// Memory charged per byte of schema text for its compiled validator
/// (~27 measured for a schema of plain properties).
const VALIDATOR_BYTES_PER_SCHEMA_BYTE: usize = 32;

/// A memo slot and its key, beyond the validator.
const ENTRY_OVERHEAD_BYTES: usize = 1_024;

/// How many schema nodes apply to the output at each depth, and what they
/// weigh (see the module doc). Computed once per schema, at issuance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    /// `paths[d]`: most schema nodes applied to one output node at depth d.
    paths: Vec<u64>,
    /// Their weights, summed.
    weight: Vec<u64>,
    /// How many of them check `uniqueItems`.
    unique: Vec<u64>,
    /// `weight`, each node counted once more per `anyOf`/`oneOf` above it.
    error_weight: Vec<u64>,
    /// `unique`, counted the same way.
    error_unique: Vec<u64>,
}

impl Profile {
    /// `paths[d]` for d in 0..=`MAX_RESULT_DEPTH`.
    pub fn paths(&self) -> &[u64] {
        &self.paths
    }

    /// `Σ paths[d]`, the bound `MAX_SCHEMA_EXPANSION` applies to.
    pub fn expansion(&self) -> u64 {
        self.paths.iter().fold(0, |a, p| a.saturating_add(*p))
    }

    /// Upper bound (in work units) of deciding whether `instance` is valid;
    /// `u64::MAX` if it is deeper than the profile covers.
    pub fn work(&self, instance: &Value) -> u64 {
        self.estimate(instance, &self.weight, &self.unique)
    }

    /// Upper bound of collecting `instance`'s validation errors.
    pub fn error_work(&self, instance: &Value) -> u64 {
        self.estimate(instance, &self.error_weight, &self.error_unique)
    }

    fn estimate(&self, instance: &Value, weight: &[u64], unique: &[u64]) -> u64 {
        let Some(cost) = instance_cost(instance) else {
            return u64::MAX;
        };
        // Deepest first, so `below` is what every node at depth d holds.
        let mut below = 0u64;
        let mut work = 0u64;
        for d in (0..DEPTHS).rev() {
            below = below.saturating_add(cost[d]);
            work = work
                .saturating_add(weight[d].saturating_mul(cost[d]))
                .saturating_add(
                    unique[d]
                        .saturating_mul(UNIQUE_ITEMS_FACTOR)
                        .saturating_mul(below),
                );
        }
        work
    }
}

/// Cost of the output's nodes at each depth (module doc), without
/// recursion; `None` if it is deeper than `MAX_RESULT_DEPTH`.
fn instance_cost(instance: &Value) -> Option<[u64; DEPTHS]> {
    let mut cost = [0u64; DEPTHS];
    let mut stack = vec![(instance, 0usize, 0usize)];
    while let Some((value, depth, key_bytes)) = stack.pop() {
        let slot = cost.get_mut(depth)?;
        let own = match value {
            Value::String(s) => s.len(),
            Value::Array(items) => {
                stack.extend(items.iter().map(|v| (v, depth + 1, 0)));
                items.len()
            }
            Value::Object(map) => {
                stack.extend(map.iter().map(|(k, v)| (v, depth + 1, k.len())));
                map.len() + map.keys().map(String::len).sum::<usize>()
            }
            _ => 0,
        };
        let own = u64::try_from(1 + key_bytes + own).unwrap_or(u64::MAX);
        *slot = slot.saturating_add(own);
    }
    Some(cost)
}

/// Profiles a schema (module doc): refuses references it cannot resolve in
/// the document, a `$ref` cycle that never descends, patterns the regex
/// engine would not take, and an expansion past `MAX_SCHEMA_EXPANSION`.
pub fn profile(schema: &Value) -> Result<Profile, String> {
    profile_scanned(schema, &Scan::of(schema))
}

fn profile_scanned(schema: &Value, scan: &Scan<'_>) -> Result<Profile, String> {
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
struct Scan<'a> {
    anchors: HashMap<&'a str, Option<&'a Value>>,
    patterns: HashSet<&'a str>,
}

impl<'a> Scan<'a> {
    fn of(root: &'a Value) -> Self {
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

/// What the profile adds up per depth (module doc), saturating.
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
    /// over the nodes in `order` (children first; module doc).
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

fn len(n: usize) -> u64 {
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

/// Automaton positions a pattern can keep alive at once: its atoms, each
/// bounded repetition counted out (`x{50}` is 50), as the engine compiles
/// it (`jsonschema`'s translation and edge collapsing). 1 when `jsonschema`
/// counts characters instead (`^X{m,n}$`).
fn pattern_weight(pattern: &str) -> Result<u64, String> {
    let unsupported = || {
        format!(
            "pattern {} is not a regular expression the broker supports (ECMA-262, no look-around or backreferences)",
            echo(pattern)
        )
    };
    let translated = jsonschema_regex::to_rust_regex(pattern).map_err(|()| unsupported())?;
    let engine = match jsonschema_regex::search_form(pattern, &translated) {
        Some(jsonschema_regex::Search::RepeatedClass(_)) => return Ok(1),
        Some(jsonschema_regex::Search::Collapsed(collapsed)) => Cow::Owned(collapsed),
        None => translated,
    };
    let hir = regex_syntax::Parser::new()
        .parse(&engine)
        .map_err(|_| unsupported())?;
    Ok(positions(&hir))
}

/// See `pattern_weight`; without recursion.
fn positions(hir: &Hir) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![(hir, 1u64)];
    while let Some((hir, copies)) = stack.pop() {
        match hir.kind() {
            HirKind::Empty => {}
            HirKind::Literal(literal) => {
                total = total.saturating_add(copies.saturating_mul(len(literal.0.len())));
            }
            HirKind::Class(_) | HirKind::Look(_) => total = total.saturating_add(copies),
            HirKind::Repetition(repetition) => {
                // `x{m,n}` compiles n copies, `x{m,}` m copies and a loop.
                let count = repetition
                    .max
                    .unwrap_or_else(|| repetition.min.saturating_add(1))
                    .max(1);
                stack.push((&repetition.sub, copies.saturating_mul(u64::from(count))));
            }
            HirKind::Capture(capture) => stack.push((&capture.sub, copies)),
            HirKind::Concat(parts) | HirKind::Alternation(parts) => {
                stack.extend(parts.iter().map(|part| (part, copies)));
            }
        }
    }
    total.max(1)
}

/// A schema compiled for validation, with its profile.
pub struct Compiled {
    validator: jsonschema::Validator,
    profile: Profile,
    /// What it is charged in the memo, in bytes (an over-estimate).
    charge: usize,
}

impl Compiled {
    pub fn validator(&self) -> &jsonschema::Validator {
        &self.validator
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }
}

/// Compiles and profiles a schema, or says why it cannot be used: more
/// than `MAX_SCHEMA_PATTERNS` patterns, one that does not compile within
/// the regex limits, remote references (never fetched), or a profile
/// refusal. Remembered by the SHA-256 of the schema's text, so a contract's
/// schema is compiled once, not at every judgment; a hit answers what
/// compiling would.
pub fn compile(schema: &Value) -> Result<Arc<Compiled>, String> {
    let (key, bytes) = fingerprint(schema);
    let memo = COMPILED.get_or_init(Default::default);
    if let Some(hit) = lock(memo).entries.get(&key) {
        return Ok(Arc::clone(hit));
    }
    let compiled = Arc::new(compile_uncached(schema, bytes)?);
    lock(memo).remember(
        key,
        Arc::clone(&compiled),
        MAX_COMPILED_SCHEMAS,
        MAX_COMPILED_SCHEMA_BYTES,
    );
    Ok(compiled)
}

fn compile_uncached(schema: &Value, bytes: usize) -> Result<Compiled, String> {
    let scan = Scan::of(schema);
    if scan.patterns.len() > MAX_SCHEMA_PATTERNS {
        return Err(format!(
            "has {} distinct patterns, at most MAX_SCHEMA_PATTERNS ({MAX_SCHEMA_PATTERNS})",
            scan.patterns.len()
        ));
    }
    // The profile first: it refuses what the validator library must not
    // even compile (a schema it would leak, one that would never end).
    let profile = profile_scanned(schema, &scan)?;
    let validator = build(&clocked(schema)).map_err(|e| {
        let regex = matches!(e.kind(), jsonschema::error::ValidationErrorKind::Format { format } if format == "regex");
        if regex {
            format!(
                "does not compile as a JSON Schema: {e} (patterns must be ECMA-262 without look-around or backreferences, and compile within REGEX_SIZE_LIMIT_BYTES ({REGEX_SIZE_LIMIT_BYTES}))"
            )
        } else {
            format!("does not compile as a JSON Schema: {e}")
        }
    })?;
    let patterns = scan.patterns.len();
    let charge = ENTRY_OVERHEAD_BYTES
        .saturating_add(bytes.saturating_mul(VALIDATOR_BYTES_PER_SCHEMA_BYTE))
        .saturating_add(
            patterns.saturating_mul(REGEX_SIZE_LIMIT_BYTES + REGEX_DFA_SIZE_LIMIT_BYTES),
        );
    Ok(Compiled {
        validator,
        profile,
        charge,
    })
}

/// The validator, offline (remote references fail) and with small regex
/// limits: a pattern whose automaton would pass `REGEX_SIZE_LIMIT_BYTES`
/// fails at once instead of taking seconds to build.
fn build(schema: &Value) -> Result<jsonschema::Validator, jsonschema::ValidationError<'static>> {
    jsonschema::options()
        .offline()
        .with_keyword(CLOCK_KEYWORD, |_, _, _| Ok(Box::new(Clock)))
        .with_format("regex", regex_format)
        .with_pattern_options(
            jsonschema::PatternOptions::regex()
                .size_limit(REGEX_SIZE_LIMIT_BYTES)
                .dfa_size_limit(REGEX_DFA_SIZE_LIMIT_BYTES),
        )
        .build(schema)
}

/// The keyword the broker adds to every schema object it compiles, so that
/// validation can stop at a deadline (`within`): the validator checks it
/// at every schema node it enters. Reserved: a client's schema never
/// sees it (`clocked` adds it to a copy).
const CLOCK_KEYWORD: &str = "x-delegation-broker-clock";

thread_local! {
    /// The deadline of the validation running on this thread (`within`).
    static DEADLINE: std::cell::Cell<Option<std::time::Instant>> =
        const { std::cell::Cell::new(None) };
    /// The clock was found past the deadline during it.
    static OUT_OF_TIME: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `CLOCK_KEYWORD`'s check: holds until the thread's deadline, then fails
/// every node the validator enters.
struct Clock;

impl<'i> jsonschema::Keyword<'i> for Clock {
    fn validate(&self, _: &'i Value) -> Result<(), jsonschema::ValidationError<'i>> {
        if on_time() {
            Ok(())
        } else {
            Err(jsonschema::ValidationError::custom(
                "validation time exceeds the limit",
            ))
        }
    }

    fn is_valid(&self, _: &'i Value) -> bool {
        on_time()
    }
}

fn on_time() -> bool {
    let Some(deadline) = DEADLINE.with(std::cell::Cell::get) else {
        return true;
    };
    if std::time::Instant::now() < deadline {
        return true;
    }
    OUT_OF_TIME.with(|o| o.set(true));
    false
}

/// Runs `validate` (a validation with a compiled schema) so that it stops
/// at `deadline`; `None` when it ran out of time (then its answer means
/// nothing: a node cut short inside a `not` reads as valid).
pub fn within<T>(deadline: std::time::Instant, validate: impl FnOnce() -> T) -> Option<T> {
    DEADLINE.with(|d| d.set(Some(deadline)));
    OUT_OF_TIME.with(|o| o.set(false));
    let answer = validate();
    DEADLINE.with(|d| d.set(None));
    (!OUT_OF_TIME.with(std::cell::Cell::get)).then_some(answer)
}

/// A copy of `schema` with `CLOCK_KEYWORD` in every schema object: the
/// root and every subschema position (applicators, `properties` and the
/// like, `$defs`/`definitions` that references reach). Recursive in the
/// schema's nesting, which its parser bounds.
fn clocked(schema: &Value) -> Value {
    let Value::Object(map) = schema else {
        return schema.clone();
    };
    let each = |v: &Value| match v {
        Value::Array(items) => Value::Array(items.iter().map(clocked).collect()),
        other => clocked(other),
    };
    let values = |v: &Value| match v {
        Value::Object(entries) => Value::Object(
            entries
                .iter()
                .map(|(k, sub)| (k.clone(), clocked(sub)))
                .collect(),
        ),
        other => other.clone(),
    };
    let mut out = serde_json::Map::with_capacity(map.len() + 1);
    for (key, value) in map {
        let value = match key.as_str() {
            "allOf" | "anyOf" | "oneOf" | "prefixItems" | "items" => each(value),
            "not"
            | "if"
            | "then"
            | "else"
            | "additionalProperties"
            | "propertyNames"
            | "unevaluatedProperties"
            | "additionalItems"
            | "contains"
            | "unevaluatedItems" => clocked(value),
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas"
            | "dependencies" => values(value),
            _ => value.clone(),
        };
        out.insert(key.clone(), value);
    }
    out.insert(CLOCK_KEYWORD.to_owned(), Value::Bool(true));
    Value::Object(out)
}

/// `"format": "regex"`, checked by the broker: at most
/// `MAX_REGEX_FORMAT_BYTES`, translated as `pattern`s are, and parsed with
/// nesting bounded by `MAX_REGEX_FORMAT_NEST` (no automaton is built):
/// linear in the string, where the library's own check is quadratic in
/// nested groups.
fn regex_format(text: &str) -> bool {
    if text.len() > MAX_REGEX_FORMAT_BYTES {
        return false;
    }
    let Ok(translated) = jsonschema_regex::to_rust_regex(text) else {
        return false;
    };
    regex_syntax::ParserBuilder::new()
        .nest_limit(MAX_REGEX_FORMAT_NEST)
        .build()
        .parse(&translated)
        .is_ok()
}

/// SHA-256 of the schema's text (as serialized: equal texts are equal
/// values) and its length.
fn fingerprint(schema: &Value) -> ([u8; 32], usize) {
    struct Hasher(Sha256, usize);
    impl std::io::Write for Hasher {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            self.1 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut hasher = Hasher(Sha256::new(), 0);
    // Writing to a hasher cannot fail, nor can serializing a `Value`.
    let _ = serde_json::to_writer(&mut hasher, schema);
    (hasher.0.finalize().into(), hasher.1)
}

/// Schemas that compiled and profiled, by `fingerprint`: compiling one
/// costs up to ~0.1 s, and a contract's completion is judged once or twice
/// more. A memo of a pure function holding only successes.
static COMPILED: OnceLock<Mutex<Memo>> = OnceLock::new();

#[derive(Default)]
struct Memo {
    entries: HashMap<[u8; 32], Arc<Compiled>>,
    /// Their charges, summed: the memo's bound.
    bytes: usize,
}

impl Memo {
    /// Adds an entry, forgetting everything first if it would pass either
    /// bound (refilling costs one compile per schema, as with no memo at
    /// all — so flooding it costs no more than not having it).
    fn remember(
        &mut self,
        key: [u8; 32],
        compiled: Arc<Compiled>,
        capacity: usize,
        capacity_bytes: usize,
    ) {
        let charge = compiled.charge;
        if charge > capacity_bytes || self.entries.contains_key(&key) {
            return;
        }
        if self.entries.len() >= capacity || self.bytes.saturating_add(charge) > capacity_bytes {
            self.entries.clear();
            self.bytes = 0;
        }
        self.entries.insert(key, compiled);
        self.bytes += charge;
    }
}

fn lock(memo: &Mutex<Memo>) -> MutexGuard<'_, Memo> {
    // Inserts are single calls: a poisoned memo is still a correct one.
    memo.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
#[path = "schema_tests.rs"]
mod tests;
