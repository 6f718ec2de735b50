//! The validation deadline: a reserved keyword in every compiled schema
//! object whose check fails once the thread's deadline has passed.

use serde_json::Value;

/// The keyword the broker adds to every schema object it compiles, so that
/// validation can stop at a deadline (`within`): the validator checks it
/// at every schema node it enters. Reserved: a client's schema never
/// sees it (`clocked` adds it to a copy).
pub(super) const CLOCK_KEYWORD: &str = "x-delegation-broker-clock";

thread_local! {
    /// The deadline of the validation running on this thread (`within`).
    static DEADLINE: std::cell::Cell<Option<std::time::Instant>> =
        const { std::cell::Cell::new(None) };
    /// The clock was found past the deadline during it.
    static OUT_OF_TIME: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `CLOCK_KEYWORD`'s check: holds until the thread's deadline, then fails
/// every node the validator enters.
pub(super) struct Clock;

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
pub(super) fn clocked(schema: &Value) -> Value {
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
