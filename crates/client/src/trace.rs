//! The W3C trace context a call to the broker carries, so a gateway's
//! span and the broker's join one trace.

/// A `traceparent` as W3C writes it (version 00): passed on only then.
pub fn valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    parts.len() == 4
        && hex(parts[0], 2)
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
}

/// A request to the broker carrying the trace context, when there is one.
pub fn traced<T>(message: T, trace: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = trace.and_then(|t| t.parse().ok()) {
        request.metadata_mut().insert("traceparent", value);
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_w3c_traceparent_is_passed_on() {
        assert!(valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(!valid_traceparent(bad), "{bad}");
        }
        let request = traced(
            (),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        assert!(request.metadata().get("traceparent").is_some());
        assert!(traced((), None).metadata().get("traceparent").is_none());
    }
}
