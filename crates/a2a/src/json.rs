//! Strict JSON for what the gateway decides on: a body with a duplicate
//! key anywhere is refused, so the gateway and the agent behind it (whose
//! parser may keep the first duplicate where serde_json keeps the last)
//! cannot read two different requests from the same bytes. Bounded in
//! bytes and depth.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Deepest nesting of objects and arrays taken (A2A requests nest a few
/// levels; serde_json's own limit is 128).
pub const MAX_JSON_DEPTH: usize = 64;

/// Parses `body` (at most `max_bytes`) into a value, refusing duplicate
/// keys at any level and nesting past `MAX_JSON_DEPTH`.
pub fn parse_strict(body: &[u8], max_bytes: usize) -> Result<Value, String> {
    if body.len() > max_bytes {
        return Err(format!("{} bytes, at most {max_bytes}", body.len()));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = Strict { depth: 0 }
        .deserialize(&mut deserializer)
        .map_err(|e| e.to_string())?;
    deserializer.end().map_err(|e| e.to_string())?;
    Ok(value)
}

/// What a refusal of a body says.
pub fn refusal_text(error: &str) -> String {
    format!(
        "not JSON the gateway takes (no duplicate keys, at most {MAX_JSON_DEPTH} levels deep): {error}"
    )
}

/// One value at `depth`.
#[derive(Clone, Copy)]
struct Strict {
    depth: usize,
}

impl Strict {
    fn inner<E: de::Error>(self) -> Result<Self, E> {
        if self.depth >= MAX_JSON_DEPTH {
            return Err(E::custom(format!(
                "nested deeper than {MAX_JSON_DEPTH} levels"
            )));
        }
        Ok(Self {
            depth: self.depth + 1,
        })
    }
}

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("a number JSON cannot hold"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let inner = self.inner()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(inner)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let inner = self.inner()?;
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format!(
                    "duplicate key {:?}",
                    broker_client::names::cut(&key, crate::ext::MAX_ECHOED_NAME_BYTES)
                )));
            }
            let value = map.next_value_seed(inner)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        let ok = br#"{"a": {"b": [1, {"c": true}]}, "d": null}"#;
        assert_eq!(
            parse_strict(ok, 1024).unwrap(),
            serde_json::from_slice::<Value>(ok).unwrap()
        );
        for body in [
            &br#"{"method": "GetTask", "method": "SendMessage"}"#[..],
            br#"{"params": {"message": {"taskId": "a", "taskId": "b"}}}"#,
            br#"[{"x": 1, "x": 1}]"#,
        ] {
            let error = parse_strict(body, 1024).unwrap_err();
            assert!(error.contains("duplicate key"), "{error}");
        }
    }

    #[test]
    fn depth_bytes_and_trailing_text_are_bounded() {
        let deep = "[".repeat(MAX_JSON_DEPTH + 1) + &"]".repeat(MAX_JSON_DEPTH + 1);
        assert!(parse_strict(deep.as_bytes(), 1 << 20).is_err());
        let fits = "[".repeat(MAX_JSON_DEPTH) + &"]".repeat(MAX_JSON_DEPTH);
        assert!(parse_strict(fits.as_bytes(), 1 << 20).is_ok());
        assert!(parse_strict(b"{}", 1).is_err());
        assert!(parse_strict(b"{} {}", 1024).is_err());
    }
}
